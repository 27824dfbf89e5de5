"""Training over a draft vocabulary: the loss covers the head's draft ids only, teacher renormalized.

Real tiny modules (the toy `tiny` target, vocab 96, a one-layer head), a head folder on disk, a Lightning
fit whose exported head must carry the set it was trained on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fake_rows import random_rows
from lightning.pytorch import Trainer
from tiny_heads import perturbed_head

from jetflow_pl.errors import UserInputError
from jetflow_pl.head import DraftHead
from jetflow_pl.head.draft_vocab import draft_columns, draft_vocab_of, load_draft_vocab, set_draft_vocab
from jetflow_pl.target import TargetModel
from jetflow_pl.training import distill_step
from jetflow_pl.training.callbacks import HFHeadExport
from jetflow_pl.training.data import DistillDataModule
from jetflow_pl.training.module import DistillationModule

VOCAB = 96  # conftest.TINY_VOCAB
MASK_ID = VOCAB - 1
#: every third id from 3 on, plus EOS: a set that leaves out most data tokens, so a wrong column
#: mapping or a loss over the full vocabulary cannot go unnoticed
SET = torch.tensor([1] + list(range(3, VOCAB - 1, 3)), dtype=torch.long)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    target = TargetModel.from_pretrained(tiny_target_dir)
    head = perturbed_head(target, MASK_ID, 4, True, 0)
    target.set_taps(head.target_layer_ids)
    return target, head


def _module_args(target_dir) -> dict:
    """DistillationModule arguments for the tiny target (block 4, toy MASK id 2)."""
    return dict(target_path=str(target_dir), block_size=4, mask_token_id=2, num_anchors=4, warmup_steps=1)


def _trainer(root: Path, max_steps: int, **kw) -> Trainer:
    """A quiet CPU trainer for `max_steps` steps (no logger, no checkpoints, no sanity validation)."""
    return Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        **kw,
    )


def _batch(seed: int = 5, B: int = 2, S: int = 20):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, MASK_ID, (B, S), generator=g)
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    loss_mask[:, 3:] = True
    return ids, loss_mask


def _step(target, head, kind, vocab, seed=1):
    ids, lm = _batch()
    return distill_step(
        target,
        head,
        ids,
        lm,
        num_anchors=4,
        loss_kind=kind,
        chunk_size=5,
        generator=torch.Generator().manual_seed(seed),
        return_hidden=True,
        draft_vocab=vocab,
    )


def test_draft_columns_map_ids_to_their_place_in_the_set_and_minus_one_outside():
    ids = torch.tensor([0, 1, 2, 3, 6, 93, 94, 95])
    cols = draft_columns(ids, SET)
    expect = [SET.tolist().index(int(i)) if int(i) in SET.tolist() else -1 for i in ids]
    assert cols.tolist() == expect
    assert cols.tolist()[:3] == [-1, 0, -1]  # 0 and 2 are not in the set, 1 (EOS) is its first column


def test_forward_kl_over_the_set_is_the_teachers_distribution_renormalized_over_it(tiny):
    target, head = tiny
    out = _step(target, head, "forward_kl", SET)
    # the definition, from the full-vocabulary logits: keep the set's columns, renormalize both sides
    w = target.lm_head.weight.float()
    s = (out["student_hidden"].float() @ w.T)[:, SET]
    t = (out["teacher_hidden"].float() @ w.T)[:, SET]
    log_p, log_q = F.log_softmax(t, -1), F.log_softmax(s, -1)
    want = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    # fp32 sums over <= 32 columns: agreement to a few ulps of the per-row KL, far below the gap to the
    # full-vocabulary loss checked next
    assert float(out["loss"].detach()) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    full = _step(target, head, "forward_kl", None)
    assert torch.equal(full["student_hidden"], out["student_hidden"])  # same anchors, same head rows
    assert abs(float(full["loss"]) - float(want)) > 1e-3
    # agreement: argmax inside the set on both sides
    agree = (s.argmax(-1) == t.argmax(-1)).long()
    assert int(out["agree_correct"].sum()) == int(agree.sum())


def test_gradients_reach_only_the_set_rows_of_the_projection(tiny):
    target, _ = tiny
    head = perturbed_head(target, MASK_ID, 4, True, 3).train()
    out = _step(target, head, "forward_kl", SET)
    out["loss"].backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in head.parameters())
    assert any(float(p.grad.abs().sum()) > 0 for p in head.layers.parameters())
    assert all(p.grad is None for p in target.parameters())


def test_ce_drops_labels_outside_the_set_and_scores_the_rest_over_the_set(tiny):
    target, head = tiny
    out = _step(target, head, "ce", SET)
    ids = draft_columns(torch.arange(VOCAB), SET)
    cols = out["labels"]
    inside = cols >= 0
    assert 0 < int(inside.sum()) < cols.numel()  # the batch has tokens on both sides of the set
    assert set(ids[ids >= 0].tolist()) >= set(cols[inside].tolist())
    w = target.lm_head.weight.float()
    s = (out["student_hidden"].float() @ w.T)[:, SET]
    want = F.cross_entropy(s[inside], cols[inside])
    # as above: fp32 over <= 32 columns
    assert float(out["loss"].detach()) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    # agreement stays the teacher's argmax, inside the set, on every row
    t = (out["teacher_hidden"].float() @ w.T)[:, SET]
    assert int(out["agree_correct"].sum()) == int((s.argmax(-1) == t.argmax(-1)).sum())


@pytest.fixture(scope="module")
def vocab_head_dir(tiny, tmp_path_factory) -> Path:
    target, head = tiny
    out = tmp_path_factory.mktemp("vocab_head") / "head"
    copy = perturbed_head(target, MASK_ID, 4, True, 0)
    set_draft_vocab(copy, SET).save_pretrained(out)
    return out


def test_load_draft_vocab_reads_the_heads_set_and_refuses_a_head_without_one(vocab_head_dir, tmp_path):
    assert torch.equal(load_draft_vocab(vocab_head_dir, VOCAB), SET)
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        load_draft_vocab(vocab_head_dir, 50)
    plain = tmp_path / "plain"
    DraftHead.from_pretrained(str(vocab_head_dir)).save_pretrained(plain)
    set_draft_vocab(DraftHead.from_pretrained(str(plain)), None).save_pretrained(plain)
    with pytest.raises(ValueError, match="full vocabulary"):
        load_draft_vocab(plain, VOCAB)
    with pytest.raises(FileNotFoundError):
        load_draft_vocab(tmp_path / "nothing", VOCAB)


def test_fit_on_the_set_exports_a_head_that_drafts_from_it(tiny_target_dir, vocab_head_dir, tmp_path):
    from datasets import Dataset

    data = tmp_path / "regen"
    Dataset.from_list(random_rows(40, VOCAB, 0)).save_to_disk(str(data / "dataset"))
    module = DistillationModule(**_module_args(tiny_target_dir), draft_vocab=str(vocab_head_dir))
    assert torch.equal(draft_vocab_of(module.head), SET)
    trainer = _trainer(
        tmp_path,
        3,
        limit_val_batches=1,
        val_check_interval=3,
        callbacks=[
            HFHeadExport(str(tmp_path / "head")),
            HFHeadExport(str(tmp_path / "bf16"), save_dtype="bfloat16"),
        ],
    )
    dm = DistillDataModule(dataset_path=str(data), seq_len=64, batch_size=2, val_fraction=0.1, max_val_rows=2)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3 and torch.isfinite(trainer.callback_metrics["train/loss"])
    exported = DraftHead.from_pretrained(str(tmp_path / "head" / "last"))
    assert int(exported.config.draft_vocab_size) == SET.numel()
    assert torch.equal(draft_vocab_of(exported), SET)
    # the bfloat16 export: the same weights rounded once, the set intact, the module still float32
    half = DraftHead.from_pretrained(str(tmp_path / "bf16" / "last"), torch_dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in module.head.parameters())
    for (name, p), q in zip(exported.named_parameters(), half.parameters(), strict=True):
        assert q.dtype == torch.bfloat16 and torch.equal(q, p.to(torch.bfloat16)), name
    assert torch.equal(draft_vocab_of(half), SET)
    with pytest.raises(ValueError, match="save_dtype"):
        HFHeadExport(str(tmp_path / "x"), save_dtype="int8")
    with pytest.raises(UserInputError, match="full vocabulary|model.safetensors"):
        DistillationModule(
            target_path=str(tiny_target_dir), block_size=4, mask_token_id=2, draft_vocab=str(tmp_path)
        )


def _skewed_rows(n: int, seed: int = 0) -> list[dict]:
    """Prompts from ids 60..90, responses from ids 10..40 only: a set counted from the responses must be
    exactly 10..40 (+ the kept special ids), one counted over whole rows would take prompt ids."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        p, r = rng.randint(12, 20), rng.randint(16, 30)
        ids = [rng.randint(60, 90) for _ in range(p)] + [rng.randint(10, 40) for _ in range(r)]
        rows.append(
            {
                "id": f"{i:05d}",
                "domain": "math",
                "input_ids": ids,
                "loss_mask": [0] * p + [1] * r,
                "prompt_len": p,
                "response": "",
                "finish_reason": "length",
            }
        )
    return rows


def test_draft_vocab_size_counts_the_set_from_the_training_responses(tiny_target_dir, tmp_path):
    from datasets import Dataset

    data = tmp_path / "regen"
    Dataset.from_list(_skewed_rows(60)).save_to_disk(str(data / "dataset"))
    common = _module_args(tiny_target_dir)
    module = DistillationModule(**common, draft_vocab_size=31 + 2)
    assert draft_vocab_of(module.head) is None  # counted at setup, from the data
    trainer = _trainer(
        tmp_path,
        2,
        limit_val_batches=0,
        callbacks=[HFHeadExport(str(tmp_path / "head"))],
    )
    dm = DistillDataModule(dataset_path=str(data), seq_len=64, batch_size=2, val_fraction=0.1, max_val_rows=2)
    trainer.fit(module, datamodule=dm)
    special = sorted({module.head.config.eos_token_id, module.head.config.pad_token_id} - {None})
    assert len(special) == 2
    want = sorted(set(special) | set(range(10, 41)))
    assert draft_vocab_of(module.head).tolist() == want
    assert draft_vocab_of(DraftHead.from_pretrained(str(tmp_path / "head" / "last"))).tolist() == want
    with pytest.raises(UserInputError, match="exclude each other"):
        DistillationModule(**common, draft_vocab_size=8, draft_vocab=str(tmp_path / "head" / "last"))
    with pytest.raises(UserInputError, match="draft_vocab_size must be >= 1"):
        DistillationModule(**common, draft_vocab_size=0)
