"""The Lightning distillation stage on the tiny random target: fit, checkpoint contents, export, resume,
clear errors before training, and the packing data module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fake_rows import random_rows
from lightning.pytorch import Callback, Trainer

from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.training.callbacks import AcceptanceLengthCallback, HFHeadExport
from jetflow_pl.training.data import DistillDataModule, pack_documents
from jetflow_pl.training.module import DistillationModule

VOCAB = 96  # conftest.TINY_VOCAB
MASK_ID = 2  # toy convention: 0 pad, 1 eos, 2 mask


def _random_docs(n: int, seed: int = 0) -> list[dict]:
    return random_rows(n, VOCAB, seed)


@pytest.fixture(scope="module")
def random_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder in the regeneration schema, with random token ids (no tokenizer needed)."""
    from datasets import Dataset

    out = tmp_path_factory.mktemp("regen") / "dataset"
    Dataset.from_list(_random_docs(80)).save_to_disk(str(out))
    return out.parent  # the output root: the data module finds `dataset/` inside


def _module(target_dir: Path, **kw) -> DistillationModule:
    args = dict(
        target_path=str(target_dir),
        block_size=4,
        mask_token_id=MASK_ID,
        num_anchors=4,
        lr=1e-3,
        warmup_steps=1,
        seed=0,
    )
    args.update(kw)
    return DistillationModule(**args)


def _data(dataset_dir: Path, **kw) -> DistillDataModule:
    args = dict(dataset_path=str(dataset_dir), seq_len=64, batch_size=2, val_fraction=0.1, max_val_rows=2)
    args.update(kw)
    return DistillDataModule(**args)


def _trainer(root: Path, max_steps: int, callbacks=(), **kw) -> Trainer:
    args = dict(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(root),
        callbacks=list(callbacks),
    )
    args.update(kw)
    return Trainer(**args)


class RecordAnchors(Callback):
    """Records (global_step, anchors) of every training step."""

    def __init__(self) -> None:
        self.seen: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from jetflow_pl.training.anchors import sample_anchors

        gen = pl_module.anchor_generator(batch_idx)
        anchors, _ = sample_anchors(
            batch["loss_mask"].bool(), batch["doc_ids"], pl_module.head.block_size, 4, gen
        )
        self.seen[trainer.global_step] = anchors.clone()


# ------------------------------------------------------------------------------------------ packing
def test_pack_documents_concat_and_whole() -> None:
    docs = [
        {"input_ids": [5] * 5, "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [6] * 4, "loss_mask": [0, 1, 1, 1]},
        {"input_ids": [7] * 3, "loss_mask": [0, 1, 1]},
    ]
    packed = pack_documents(docs, seq_len=8, pad_token_id=0, split_documents=True)
    assert packed["input_ids"].tolist() == [[5, 5, 5, 5, 5, 6, 6, 6], [6, 7, 7, 7, 0, 0, 0, 0]]
    assert packed["doc_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2, 2]]
    assert packed["loss_mask"][1].tolist() == [True, False, True, True, False, False, False, False]
    whole = pack_documents(docs, seq_len=8, pad_token_id=0, split_documents=False)
    assert whole["input_ids"].tolist() == [[5, 5, 5, 5, 5, 0, 0, 0], [6, 6, 6, 6, 7, 7, 7, 0]]
    assert whole["doc_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 2]]
    assert not whole["loss_mask"][0, 5:].any() and not whole["loss_mask"][1, 7]


def test_datamodule_deterministic_split(random_dataset: Path) -> None:
    a, b = (_data(random_dataset, seed=3, max_val_rows=None) for _ in range(2))
    a.setup("fit")
    b.setup("fit")
    for k in ("input_ids", "loss_mask", "doc_ids"):
        assert torch.equal(a.train_rows[k], b.train_rows[k])
    # every response token lands in train or val, none twice (no duplication, no loss of tokens)
    total = sum(sum(d["loss_mask"]) for d in _random_docs(80))
    assert int(a.train_rows["loss_mask"].sum()) + int(a.val_rows["loss_mask"].sum()) == total
    assert a.val_rows["input_ids"].shape[0] >= 1
    c = _data(random_dataset, seed=4)
    c.setup("fit")
    assert not torch.equal(a.train_rows["input_ids"], c.train_rows["input_ids"])
    batch = next(iter(a.train_dataloader()))
    assert batch["input_ids"].shape == (2, 64) and batch["loss_mask"].dtype == torch.bool


# ------------------------------------------------------------------------------------------ fit
def test_fit_checkpoint_holds_only_head_and_export_loads(
    tiny_target_dir: Path, random_dataset: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    module = _module(tiny_target_dir)
    export = HFHeadExport(str(tmp_path / "head"))
    tau_cb = AcceptanceLengthCallback(
        every_n_steps=0, budget=8, width=2, max_new_tokens=6, prompt_token_ids=[[3, 4, 5, 6], [7, 8, 9]]
    )
    trainer = _trainer(tmp_path, 3, [tau_cb, export], limit_val_batches=1, val_check_interval=3)
    with caplog.at_level("INFO"):
        trainer.fit(module, datamodule=_data(random_dataset))
    assert trainer.global_step == 3
    # the end of fit says how to serve the best head: here, and exported for vLLM and SGLang
    said = caplog.text
    best = tmp_path / "head" / "best"
    assert f"jetflow-serve --target {tiny_target_dir} --head {best}" in said
    assert f"jetflow-export --format vllm --head {best} --target {tiny_target_dir} --out {best}-vllm" in said
    assert '"num_speculative_tokens": 3' in said and "--speculative-algorithm DFLASH" in said
    assert "train/loss" in trainer.callback_metrics and "val/sim_tau" in trainer.callback_metrics
    assert tau_cb.history and tau_cb.history[-1]["tau"] >= 1.0
    assert float(trainer.callback_metrics["val/tau"]) == pytest.approx(tau_cb.history[-1]["tau"])

    ckpt = tmp_path / "c.ckpt"
    trainer.save_checkpoint(str(ckpt))
    sd = torch.load(str(ckpt), map_location="cpu", weights_only=False)["state_dict"]
    assert sd and all(k.startswith("head.") for k in sd), sorted(sd)[:5]
    n_head = sum(p.numel() for p in module.head.parameters())
    assert sum(v.numel() for v in sd.values()) == n_head

    for sub in ("last", "best"):
        loaded = DraftHead.from_pretrained(str(tmp_path / "head" / sub))
        assert loaded.config.causal_head and loaded.block_size == 4
    loaded = DraftHead.from_pretrained(str(tmp_path / "head" / "last"))
    for (name, p), q in zip(module.head.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(p, q), name

    # the checkpoint restores into a fresh module (target re-loaded from target_path)
    restored = DistillationModule.load_from_checkpoint(str(ckpt))
    assert torch.equal(restored.head.fc.weight, module.head.fc.weight)


def test_resume_continues_same_step_and_anchors(
    tiny_target_dir: Path, random_dataset: Path, tmp_path: Path
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    full = RecordAnchors()
    ckpts = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
    t1 = _trainer(tmp_path / "a", 4, [full, ckpts], enable_checkpointing=True)
    m1 = _module(tiny_target_dir)
    t1.fit(m1, datamodule=_data(random_dataset))
    mid = [p for p in (tmp_path / "ckpt").iterdir() if "step=2" in p.name]
    assert len(mid) == 1
    sd = torch.load(str(mid[0]), map_location="cpu", weights_only=False)["state_dict"]
    assert all(k.startswith("head.") for k in sd)
    resumed = RecordAnchors()
    t3 = _trainer(tmp_path / "c", 4, [resumed])
    m3 = _module(tiny_target_dir)
    t3.fit(m3, datamodule=_data(random_dataset), ckpt_path=str(mid[0]))
    assert min(resumed.seen) == 2 and t3.global_step == 4
    for step in (2, 3):
        assert torch.equal(resumed.seen[step], full.seen[step]), step
    for a, b in zip(m1.head.parameters(), m3.head.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)


# ------------------------------------------------------------------------------------------ errors
def test_layer_id_out_of_range_fails_before_training(tiny_target_dir: Path) -> None:
    with pytest.raises(ValueError, match="target_layer_ids"):
        _module(tiny_target_dir, target_layer_ids=[7])


def test_head_target_mismatch_fails_clearly(tiny_target_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(str(tiny_target_dir))
    tc.vocab_size = VOCAB + 32
    head = DraftHead(DraftHeadConfig.for_target(tc, mask_token_id=MASK_ID))
    head.save_pretrained(str(tmp_path / "other"))
    with pytest.raises(ValueError, match="vocab_size"):
        _module(tiny_target_dir, init_head_path=str(tmp_path / "other"))


def test_bad_arguments_fail_clearly(tiny_target_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="loss must be one of"):
        _module(tiny_target_dir, loss="kl")
    with pytest.raises(ValueError, match="mask_token_id"):
        _module(tiny_target_dir, mask_token_id=1)  # EOS
    with pytest.raises(ValueError, match="no config.json"):
        _module(tmp_path)
    with pytest.raises(ValueError, match="dataset_path"):
        DistillDataModule()


def test_data_outside_vocab_fails_on_first_batch(tiny_target_dir: Path, tmp_path: Path) -> None:
    from datasets import Dataset

    docs = _random_docs(20)
    docs[0]["input_ids"][0] = VOCAB + 5
    Dataset.from_list(docs).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        _trainer(tmp_path, 1).fit(
            _module(tiny_target_dir), datamodule=_data(tmp_path / "bad", val_fraction=0.0, seq_len=512)
        )


@pytest.mark.parametrize("target_dtype", ["float32", "bfloat16"])
def test_a_bfloat16_saved_head_trains_in_float32_through_tau_checks(
    tiny_target_dir: Path, random_dataset: Path, tmp_path: Path, target_dtype: str
) -> None:
    """Continuing from a head stored in bfloat16 (as the shipped SmolLM2 head is): the module trains
    float32 master weights, and the val/tau decode (whose backend casts its head to the target's dtype)
    never changes the dtype the optimizer sees. Before: bfloat16 weights for the first steps, then the
    callback's cast to float32 broke AdamW's bfloat16 state at the next step."""
    torch.manual_seed(0)
    start = _module(tiny_target_dir).head
    start.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16_head"))
    module = _module(tiny_target_dir, init_head_path=str(tmp_path / "bf16_head"), target_dtype=target_dtype)
    assert {p.dtype for p in module.head.parameters()} == {torch.float32}
    tau = AcceptanceLengthCallback(
        every_n_steps=1, budget=4, prompt_token_ids=[[5, 6, 7, 8]], max_new_tokens=4
    )
    trainer = _trainer(tmp_path, max_steps=3, callbacks=[tau])
    trainer.fit(module, datamodule=_data(random_dataset))
    assert trainer.global_step == 3 and len(tau.history) >= 2
    assert {p.dtype for p in module.head.parameters()} == {torch.float32}
