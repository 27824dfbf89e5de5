"""A head written for vLLM, SGLang and JetSpec carries every key each loader reads, as we mean it (issue 43).

Real components: the shipped toy head and target, a head given a draft vocabulary and saved, the
`jetflow-export --format` command writing real folders, and our own loader reading them back. What stock
vLLM does with such a folder is checked by `scripts/vllm_check.py` (the `slow` test in
test_vllm_interop.py); here each loader's rule (`engine_formats.LOADER_RULES`) is checked by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from data_gen.toy import SMALL_HEAD_DIR, SMALL_TARGET_DIR
from export.cli import main as export_main
from jetflow_pl.checkpoints import load_draft_head
from jetflow_pl.head import DraftHead
from jetflow_pl.head.draft_vocab import DraftLMHead, draft_vocab_of, set_draft_vocab
from jetflow_pl.head.engine_formats import (
    ENGINES,
    LOADER_RULES,
    d2t_from_draft_vocab,
    draft_vocab_from_d2t,
    read_path,
    serve_commands,
)
from jetflow_pl.target import TargetModel

pytestmark = [
    pytest.mark.skipif(
        not (SMALL_HEAD_DIR / "model.safetensors").is_file(), reason="shipped toy head missing"
    ),
    pytest.mark.usefixtures("one_thread"),
]

VOCAB = 2048
#: a draft vocabulary that is not a prefix of the ids: vLLM's "first rows of the target's lm_head" mistake
#: (issue 43, edit 4) would pick other tokens, so a test comparing logits catches it
DRAFT_IDS = torch.tensor(sorted({1, *range(3, VOCAB, 3)}), dtype=torch.int64)


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_pretrained(SMALL_TARGET_DIR, [2])


@pytest.fixture(scope="module")
def vocab_head_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("heads") / "vocab_head"
    set_draft_vocab(DraftHead.from_pretrained(str(SMALL_HEAD_DIR)).eval(), DRAFT_IDS).save_pretrained(out)
    return out


def export(head_dir, out, fmt: str, *extra: str) -> int:
    return export_main(
        [
            "--format",
            fmt,
            "--head",
            str(head_dir),
            "--target",
            str(SMALL_TARGET_DIR),
            "--out",
            str(out),
            "-q",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory, vocab_head_dir) -> dict[str, tuple]:
    """{engine: (folder, config, tensors, source head config)}: the vLLM and llama.cpp folders from the
    draft-vocab head, the SGLang and JetSpec folders from the full-vocabulary shipped head (they cannot
    honour a draft vocabulary)."""
    root = tmp_path_factory.mktemp("engine_folders")
    out = {}
    sources = {
        "vllm": vocab_head_dir,
        "llamacpp": vocab_head_dir,
        "sglang": SMALL_HEAD_DIR,
        "jetspec": SMALL_HEAD_DIR,
    }
    for engine, src in sources.items():
        assert export(src, root / engine, engine) == 0
        with safe_open(str(root / engine / "model.safetensors"), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        config = json.loads((root / engine / "config.json").read_text())
        source = json.loads((src / "config.json").read_text())
        out[engine] = (root / engine, config, tensors, source)
    return out


# what each loader's rule requires of the folder, by (engine, where): the loaders' own code paths are cited
# in jetflow_pl/head/engine_formats.py; every rule of LOADER_RULES must have its check here
def _causal(src: dict) -> bool:
    return bool(src["dflash_config"]["causal_head"])


CHECKS = {
    ("vllm", "architectures"): lambda v, cfg, t, src: v == ["DFlashDraftModel"],
    ("vllm", "is_causal"): lambda v, cfg, t, src: v is _causal(src),
    ("vllm", "dflash_config.causal"): lambda v, cfg, t, src: v is _causal(src),
    ("vllm", "layer_types"): lambda v, cfg, t, src: v == ["full_attention"] * cfg["num_hidden_layers"],
    ("vllm", "target_hidden_size"): lambda v, cfg, t, src: v == src["dflash_config"]["target_hidden_size"],
    ("vllm", "dflash_config.target_layer_ids"): lambda v, cfg, t, src: (
        v == src["dflash_config"]["target_layer_ids"]
    ),
    ("vllm", "dflash_config.mask_token_id"): lambda v, cfg, t, src: (
        v == src["dflash_config"]["mask_token_id"]
    ),
    ("vllm", "draft_vocab_size"): lambda v, cfg, t, src: v == len(DRAFT_IDS) == t["lm_head.weight"].shape[0],
    ("vllm", "d2t"): lambda v, cfg, t, src: (
        v.dtype == torch.int64 and torch.equal(draft_vocab_from_d2t(v), DRAFT_IDS)
    ),
    ("vllm", "lm_head.weight"): lambda v, cfg, t, src: tuple(v.shape) == (len(DRAFT_IDS), cfg["hidden_size"]),
    ("sglang", "architectures"): lambda v, cfg, t, src: v == ["DFlashDraftModel"],
    ("sglang", "layer_types"): lambda v, cfg, t, src: (
        v == ["sliding_attention" if _causal(src) else "full_attention"] * cfg["num_hidden_layers"]
    ),
    ("sglang", "sliding_window"): lambda v, cfg, t, src: v > cfg["max_position_embeddings"],
    ("sglang", "block_size"): lambda v, cfg, t, src: v == src["block_size"],
    ("sglang", "dflash_config.target_layer_ids"): lambda v, cfg, t, src: (
        v == src["dflash_config"]["target_layer_ids"]
    ),
    ("sglang", "dflash_config.mask_token_id"): lambda v, cfg, t, src: (
        v == src["dflash_config"]["mask_token_id"]
    ),
    ("sglang", "dflash_config.mask_token"): lambda v, cfg, t, src: (
        v == "<|mask|>"
    ),  # the toy tokenizer's id 2
    ("jetspec", "dflash_config.causal_head"): lambda v, cfg, t, src: v is _causal(src),
    ("jetspec", "dflash_config.target_layer_ids"): lambda v, cfg, t, src: (
        v == src["dflash_config"]["target_layer_ids"]
    ),
    ("jetspec", "dflash_config.target_hidden_size"): lambda v, cfg, t, src: v == cfg["hidden_size"],
    ("jetspec", "dflash_config.mask_token_id"): lambda v, cfg, t, src: (
        v == src["dflash_config"]["mask_token_id"]
    ),
    ("jetspec", "block_size"): lambda v, cfg, t, src: v == src["block_size"],
    ("jetspec", "rope_theta"): lambda v, cfg, t, src: v == src["rope_parameters"]["rope_theta"],
    ("llamacpp", "architectures"): lambda v, cfg, t, src: v == ["DSparkDraftModel"],  # the one mapping d2t
    ("llamacpp", "is_causal"): lambda v, cfg, t, src: v is _causal(src),
    ("llamacpp", "dflash_config.target_layer_ids"): lambda v, cfg, t, src: (
        v == src["dflash_config"]["target_layer_ids"]
    ),
    ("llamacpp", "dflash_config.mask_token_id"): lambda v, cfg, t, src: (
        v == src["dflash_config"]["mask_token_id"]
    ),
    ("llamacpp", "block_size"): lambda v, cfg, t, src: v == src["block_size"],
    ("llamacpp", "draft_vocab_size"): lambda v, cfg, t, src: v == len(DRAFT_IDS) == t["d2t"].numel(),
    ("llamacpp", "d2t"): lambda v, cfg, t, src: (
        v.dtype == torch.int64 and torch.equal(draft_vocab_from_d2t(v), DRAFT_IDS)
    ),
    ("llamacpp", "lm_head.weight"): lambda v, cfg, t, src: (
        tuple(v.shape) == (len(DRAFT_IDS), cfg["hidden_size"])
    ),
}


def test_every_loader_rule_has_a_check():
    assert {(r.engine, r.where) for r in LOADER_RULES} == set(CHECKS)
    assert {r.engine for r in LOADER_RULES} == set(ENGINES)


@pytest.mark.parametrize("rule", LOADER_RULES, ids=[f"{r.engine}:{r.where}" for r in LOADER_RULES])
def test_the_written_folder_satisfies_each_loaders_rule(folders, rule):
    _, config, tensors, source = folders[rule.engine]
    value = tensors[rule.where] if rule.where in tensors else read_path(config, rule.where)
    assert CHECKS[(rule.engine, rule.where)](value, config, tensors, source), (
        f"{rule.engine} {rule.where}: {rule.rule}"
    )


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_d2t_folders_hold_only_tensors_their_loaders_know(folders, vocab_head_dir, engine):
    # vLLM's loader refuses a tensor it has no parameter for ("no module or parameter named 'draft_vocab'"),
    # llama.cpp's converter one it cannot map ("Can not map tensor 'model.draft_vocab'")
    _, _, tensors, _ = folders[engine]
    with safe_open(str(vocab_head_dir / "model.safetensors"), framework="pt") as f:
        ours = set(f.keys())
    assert "draft_vocab" in ours and "draft_vocab" not in tensors
    assert set(tensors) == (ours - {"draft_vocab"}) | {"d2t", "lm_head.weight"}


def test_d2t_round_trip_and_vllms_logits_equal_ours(folders, vocab_head_dir, target):
    assert torch.equal(draft_vocab_from_d2t(d2t_from_draft_vocab(DRAFT_IDS)), DRAFT_IDS)
    _, config, tensors, _ = folders["vllm"]
    head = load_draft_head(vocab_head_dir).eval()
    ours = DraftLMHead(target, head)
    hidden = torch.randn(4, 7, target.hidden_size)
    # vLLM's DFlash compute_logits: draft logits from the folder's own lm_head rows, scattered to
    # target ids `arange + d2t`, -inf elsewhere
    draft_logits = hidden @ tensors["lm_head.weight"].float().T
    scattered = torch.full((4, 7, VOCAB), float("-inf"))
    scattered[..., torch.arange(config["draft_vocab_size"]) + tensors["d2t"]] = draft_logits
    # the same float32 rows of the same weights: equal up to the product's summation order
    torch.testing.assert_close(
        torch.log_softmax(scattered, -1), ours.dense_logprobs(hidden), atol=1e-5, rtol=0
    )
    # the mistake vLLM makes without the folder's rows (the target's first rows) ranks other tokens
    wrong = hidden @ target.model.get_output_embeddings().weight[: len(DRAFT_IDS)].T
    assert not torch.equal(wrong.argmax(-1), draft_logits.argmax(-1))


def test_our_loader_reads_every_folder_back(folders, vocab_head_dir):
    ours = load_draft_head(vocab_head_dir).state_dict()
    for engine, (folder, _, _, _) in folders.items():
        head = load_draft_head(folder)
        with_vocab = engine in ("vllm", "llamacpp")
        expected = ours if with_vocab else load_draft_head(SMALL_HEAD_DIR).state_dict()
        got = head.state_dict()
        assert set(got) == set(expected), engine
        assert all(torch.equal(got[k], expected[k]) for k in got), engine
        if with_vocab:  # the draft vocabulary came back from d2t
            assert torch.equal(draft_vocab_of(head), DRAFT_IDS)


@pytest.mark.parametrize("engine", ["sglang", "jetspec"])
def test_an_engine_that_cannot_honour_a_draft_vocab_is_refused_in_one_line(
    tmp_path, vocab_head_dir, engine, capsys
):
    out = tmp_path / engine
    assert export(vocab_head_dir, out, engine) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.count("\n") == 0
        and err.startswith("error: ")
        and "draft vocabulary" in err
        and "--full-vocab" in err
    )
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()  # nothing written
    # the explicit opt-in writes a full-vocabulary head (the engine drafts over every id anyway)
    assert export(vocab_head_dir, out, engine, "--full-vocab") == 0
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 0 and draft_vocab_of(load_draft_head(out)) is None


def test_a_full_vocabulary_head_written_for_vllm_loads_back_as_one(tmp_path):
    # vLLM reads draft_vocab_size 0 as a zero-row lm_head, so the folder says vocab_size; ours reads that back
    assert export(SMALL_HEAD_DIR, tmp_path / "vllm", "vllm") == 0
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["draft_vocab_size"] == VOCAB
    head = load_draft_head(tmp_path / "vllm")
    assert draft_vocab_of(head) is None and head.config.draft_vocab_size == 0
    expected = load_draft_head(SMALL_HEAD_DIR).state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in head.state_dict().items())


def test_a_bidirectional_head_stays_bidirectional_everywhere(tmp_path):
    head = DraftHead.from_pretrained(str(SMALL_HEAD_DIR))
    head.config.causal_head = False
    head.save_pretrained(tmp_path / "bidir")
    for engine in ENGINES:
        assert export(tmp_path / "bidir", tmp_path / engine, engine) == 0
        cfg = json.loads((tmp_path / engine / "config.json").read_text())
        assert cfg["layer_types"] == ["full_attention"] * cfg["num_hidden_layers"]  # SGLang: bidirectional
        assert cfg["dflash_config"]["causal_head"] is False
        if engine in ("vllm", "llamacpp"):
            assert cfg["is_causal"] is False and cfg["dflash_config"]["causal"] is False
            assert cfg["architectures"] == ["DFlashDraftModel"]  # no draft vocabulary: the plain class


def test_a_head_for_another_target_is_refused(tmp_path, capsys):
    # the export's load-and-check (export.onnx_export.load_pair) runs for every --format
    shutil.copytree(SMALL_HEAD_DIR, tmp_path / "head")
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    cfg["num_target_layers"] = 99
    (tmp_path / "head" / "config.json").write_text(json.dumps(cfg))
    assert export(tmp_path / "head", tmp_path / "out", "vllm") == 2
    assert "does not fit the target" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_existing_output_is_kept_without_overwrite(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert export(SMALL_HEAD_DIR, tmp_path / "out", "vllm") == 2
    assert "exists" in capsys.readouterr().err


def test_serve_commands_name_the_export_and_each_engines_flags():
    lines = serve_commands("runs/x/head/best", "models/T", 16)
    assert lines["jetflow"] == "jetflow-serve --target models/T --head runs/x/head/best"
    assert "--format vllm" in lines["vllm"] and '"num_speculative_tokens": 15' in lines["vllm"]
    assert "runs/x/head/best-vllm" in lines["vllm"].split("&&")[1]
    assert (
        "--speculative-algorithm DFLASH" in lines["sglang"]
        and "--speculative-num-draft-tokens 16" in lines["sglang"]
    )
