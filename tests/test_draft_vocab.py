"""The draft vocabulary: the head scores only its most frequent tokens, decoding stays the target's.

Real components: the shipped toy target and head, its training responses counted with its tokenizer,
a saved and reloaded head, an exported engine decoded by ONNX Runtime, the CLI on a dataset on disk.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from data_gen.toy import SMALL_HEAD_DIR, SMALL_TARGET_DIR, heldout_prompts, train_records
from data_gen.toy.tokenizer import prompt_ids
from export.onnx_export import ExportSettings, export_engine
from jetflow_pl.checkpoints import load_draft_head
from jetflow_pl.decoding.budget.cost_profile import model_identity
from jetflow_pl.decoding.generator import ARGenerator, SpeculativeGenerator
from jetflow_pl.draft_vocab_cli import main as draft_vocab_main
from jetflow_pl.errors import CheckpointError
from jetflow_pl.head import DraftHead
from jetflow_pl.head.draft_vocab import (
    DraftLMHead,
    count_tokens,
    coverage,
    draft_vocab_of,
    select_draft_vocab,
    set_draft_vocab,
)
from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel

pytestmark = [
    pytest.mark.skipif(
        not (SMALL_HEAD_DIR / "model.safetensors").is_file(), reason="shipped toy head missing"
    ),
    pytest.mark.usefixtures("one_thread"),
]

#: half the toy's 2,048 ids (its BPE vocabulary is flat: 360 training responses use ~1,500 distinct ids)
SIZE = 1024
EOS = 1


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SMALL_TARGET_DIR)


@pytest.fixture(scope="module")
def response_counts(tokenizer) -> torch.Tensor:
    """Token counts of toy *training* responses (math, code, prose): what the head learned to draft."""
    seqs = []
    for domain in ("math", "code", "prose"):
        for r in train_records(domain, 120, seed=1):
            seqs.append(tokenizer(r["response"], add_special_tokens=False)["input_ids"] + [EOS])
    return count_tokens(seqs, 2048)


@pytest.fixture(scope="module")
def vocab(response_counts) -> torch.Tensor:
    return select_draft_vocab(response_counts, SIZE, keep=[EOS])


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_pretrained(SMALL_TARGET_DIR, [2])


@pytest.fixture(scope="module")
def vocab_head_dir(tmp_path_factory, vocab):
    out = tmp_path_factory.mktemp("vocab_head") / "head"
    head = DraftHead.from_pretrained(str(SMALL_HEAD_DIR)).eval()
    set_draft_vocab(head, vocab).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [prompt_ids(tokenizer, r["prompt"]) for r in heldout_prompts("math", 6)]


def test_selection_is_the_most_frequent_ids_with_keep_and_deterministic_ties():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    assert select_draft_vocab(counts, 3).tolist() == [2, 3, 5]  # 9, 9, 7
    assert select_draft_vocab(counts, 4).tolist() == [0, 2, 3, 5]
    assert select_draft_vocab(counts, 3, keep=[6]).tolist() == [2, 3, 6]  # a never-seen EOS still kept
    tie = torch.tensor([1, 1, 1, 1])
    assert select_draft_vocab(tie, 2).tolist() == [0, 1]  # ties: lower id first, on every machine
    assert coverage(counts, torch.tensor([2, 3])) == pytest.approx(18 / 34)
    with pytest.raises(ValueError, match="size"):
        select_draft_vocab(counts, 9)
    with pytest.raises(ValueError, match="keep"):
        select_draft_vocab(counts, 2, keep=[8])
    with pytest.raises(ValueError, match="out of range"):
        count_tokens([[0, 8]], 8)


def test_the_vocab_covers_the_training_responses(response_counts, vocab):
    # the set holds the most mass any SIZE ids can (EOS, kept anyway, is among the most frequent)
    assert vocab.numel() == SIZE < 2048 and EOS in vocab.tolist()
    best = response_counts.sort(descending=True).values[:SIZE].sum() / response_counts.sum()
    assert coverage(response_counts, vocab) == pytest.approx(float(best))
    assert coverage(response_counts, vocab) > 0.9


def test_draft_logprobs_are_the_target_lm_heads_renormalized_over_the_vocab(target, vocab):
    head = set_draft_vocab(DraftHead.from_pretrained(str(SMALL_HEAD_DIR)).eval(), vocab)
    lm = DraftLMHead(target, head)
    hidden = torch.randn(3, 15, target.hidden_size)
    dense = lm.dense_logprobs(hidden)
    assert dense.shape == (3, 15, 2048)
    outside = torch.ones(2048, dtype=torch.bool)
    outside[vocab] = False
    assert bool(torch.isneginf(dense[..., outside]).all())
    full = target.lm_logits(hidden).float()
    # same rows of the same weights: equal up to summation order in the product (float32 rounding)
    torch.testing.assert_close(dense[..., vocab], torch.log_softmax(full[..., vocab], -1), atol=1e-5, rtol=0)
    assert torch.allclose(dense.exp().sum(-1), torch.ones(3, 15), atol=1e-5)


def test_the_vocab_is_saved_with_the_head_and_survives_bfloat16(tmp_path, vocab_head_dir, vocab):
    head = load_draft_head(vocab_head_dir)
    assert head.config.draft_vocab_size == SIZE
    assert torch.equal(draft_vocab_of(head), vocab)
    head.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    again = load_draft_head(tmp_path / "bf16")
    assert again.draft_vocab.dtype == torch.int64 and torch.equal(draft_vocab_of(again), vocab)
    # a full-vocabulary head stays one (no buffer, size 0)
    assert draft_vocab_of(load_draft_head(SMALL_HEAD_DIR)) is None


def test_a_config_naming_a_vocab_its_weights_lack_is_refused(tmp_path):
    DraftHead.from_pretrained(str(SMALL_HEAD_DIR)).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["draft_vocab_size"] = 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="draft_vocab_size=16, but its weights hold no draft_vocab"):
        load_draft_head(tmp_path)
    # a buffer filled with anything but sorted unique ids in range is refused where it would be used
    head = DraftHead.from_pretrained(str(SMALL_HEAD_DIR))
    with pytest.raises(ValueError, match="sorted and unique"):
        set_draft_vocab(head, torch.tensor([3, 3, 7]))
    with pytest.raises(ValueError, match="lie in"):
        set_draft_vocab(head, torch.tensor([3, 2048]))


def test_greedy_decoding_stays_the_targets_and_drafts_only_vocab_tokens(
    target, vocab_head_dir, vocab, prompts
):
    head = load_draft_head(vocab_head_dir).eval()
    backend = TorchBackend(target, head)
    ar = ARGenerator(TorchBackend(target), eos_token_id=EOS)
    gen = SpeculativeGenerator(backend, budget=16, width=4, eos_token_id=EOS)
    taus = []
    for p in prompts:
        got = gen.generate(p, 40)
        assert got.tokens == ar.generate(p, 40).tokens
        taus.append(got.tau)
    # the vocab covers what the target emits here, so speculation still happens
    assert sum(taus) / len(taus) > 2.0
    backend.prefill(torch.tensor(prompts[0]))
    drafted = torch.isfinite(backend.draft(5))
    allowed = torch.zeros(2048, dtype=torch.bool)
    allowed[vocab] = True
    assert bool(drafted.any()) and not bool((drafted & ~allowed).any())


def test_onnxruntime_engine_bakes_the_vocab_and_decodes_like_torch(
    tmp_path, target, vocab_head_dir, vocab, prompts
):
    engine = export_engine(ExportSettings(head=vocab_head_dir, target=SMALL_TARGET_DIR, out=tmp_path / "e"))
    config = json.loads((engine / "config.json").read_text())
    assert config["head"]["draft_vocab_size"] == SIZE
    ort = OnnxRuntimeBackend(engine, intra_op_threads=1)
    # a cost profile measured for the same engine over the full vocabulary does not apply to this one
    full_vocab = SimpleNamespace(config={**config, "head": {**config["head"], "draft_vocab_size": 0}})
    assert model_identity(ort)["head"] != model_identity(full_vocab)["head"]
    ort.prefill(torch.tensor(prompts[0]))
    ids = torch.isfinite(ort.draft(5)).nonzero()[:, 1].unique()
    assert set(ids.tolist()) <= set(vocab.tolist())
    torch_gen = SpeculativeGenerator(
        TorchBackend(target, load_draft_head(vocab_head_dir)), 16, 4, eos_token_id=EOS
    )
    ort_gen = SpeculativeGenerator(OnnxRuntimeBackend(engine, intra_op_threads=1), 16, 4, eos_token_id=EOS)
    for p in prompts[:4]:
        want, got = torch_gen.generate(p, 40), ort_gen.generate(p, 40)
        assert (got.tokens, got.accept_lengths) == (want.tokens, want.accept_lengths)


def test_cli_writes_a_head_with_its_vocab_and_refuses_bad_input(tmp_path, tokenizer, capsys):
    rows = []
    for r in train_records("math", 40, seed=2):
        prompt = prompt_ids(tokenizer, r["prompt"])
        response = tokenizer(r["response"], add_special_tokens=False)["input_ids"] + [EOS]
        rows.append({"input_ids": prompt + response, "loss_mask": [0] * len(prompt) + [1] * len(response)})
    data = tmp_path / "dataset"
    datasets.Dataset.from_list(rows).save_to_disk(str(data))
    out = tmp_path / "head_vd"
    assert (
        draft_vocab_main(
            ["--head", str(SMALL_HEAD_DIR), "--data", str(data), "--size", "200", "--out", str(out)]
        )
        == 0
    )
    record = json.loads((out / "draft_vocab.json").read_text())
    assert record["draft_vocab_size"] == 200 and record["rows"] == 40
    assert 0.9 < record["coverage"] <= 1.0
    head = load_draft_head(out)
    kept = draft_vocab_of(head)
    assert kept.numel() == 200 and EOS in kept.tolist()
    # prompt tokens were not counted: only response (loss_mask) tokens are what the head drafts
    counted = count_tokens([r["input_ids"][r["loss_mask"].index(1) :] for r in rows], 2048)
    assert torch.equal(kept, select_draft_vocab(counted, 200, keep=[0, EOS]))
    capsys.readouterr()

    bad = tmp_path / "bad"
    datasets.Dataset.from_list([{"input_ids": [1, 2]}]).save_to_disk(str(bad))
    args = ["--head", str(SMALL_HEAD_DIR), "--size", "200", "--out", str(tmp_path / "x")]
    assert draft_vocab_main([*args, "--data", str(bad)]) == 2
    assert "loss_mask" in capsys.readouterr().err
    assert draft_vocab_main([*args, "--data", str(tmp_path / "missing")]) == 2
    assert "no dataset" in capsys.readouterr().err
    assert draft_vocab_main([*args[:4], "--out", str(SMALL_HEAD_DIR), "--data", str(data)]) == 2
    assert not (tmp_path / "x").exists()
