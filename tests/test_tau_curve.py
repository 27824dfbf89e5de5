"""Tau vs budget during training: `AcceptanceLengthCallback(budgets=[...])` decodes the held-out prompts
once per budget, logs `val/tau@<k>` for each and `val/tau` at the main budget, and `HFHeadExport` keeps
the head that is best at any one of them."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_rows import random_rows
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

import data_gen.toy
from data_gen.toy.heldout_files import DEFAULT_DIR
from jetflow_pl.errors import UserInputError
from jetflow_pl.training.callbacks import AcceptanceLengthCallback, HFHeadExport
from jetflow_pl.training.data import DistillDataModule
from jetflow_pl.training.module import DistillationModule

SMALL = data_gen.toy.SMALL_TARGET_DIR
needs_small = pytest.mark.skipif(
    not (SMALL / "model.safetensors").is_file()
    or not (data_gen.toy.SMALL_HEAD_DIR / "config.json").is_file(),
    reason=f"no toy target/head at {SMALL}",
)
VOCAB = 96  # conftest.TINY_VOCAB
PROMPTS = [[3, 4, 5, 6], [7, 8, 9]]


def _callback(**kw) -> AcceptanceLengthCallback:
    args = dict(every_n_steps=0, width=2, max_new_tokens=6, prompt_token_ids=PROMPTS)
    args.update(kw)
    return AcceptanceLengthCallback(**args)


# ------------------------------------------------------------------------------------------ settings
def test_budget_settings_and_their_names() -> None:
    # back-compatible: no budgets = the single budget (64 by default), logged under both names
    assert (_callback().budget, _callback().budgets) == (64, [64])
    assert _callback(budget=16).metric_names() == {"val/tau": 16, "val/tau@16": 16}
    # a curve: val/tau is the main budget (the largest unless given), listed or not
    cb = _callback(budgets=[256, 16, 64])
    assert (cb.budget, cb.budgets) == (256, [16, 64, 256])
    cb = _callback(budget=64, budgets=[16, 256])
    assert (cb.budget, cb.budgets) == (64, [16, 64, 256])
    assert cb.metric_names() == {"val/tau": 64, "val/tau@16": 16, "val/tau@64": 64, "val/tau@256": 256}
    assert set(_callback(budgets=[8], metric_name="v/t").metric_names()) == {"v/t", "v/t@8"}


@pytest.mark.parametrize(
    ("kw", "what"),
    [
        (dict(budgets=[]), "is empty"),
        (dict(budgets=[16, 0]), "holds a budget < 1"),
        (dict(budgets=[-4]), "holds a budget < 1"),
        (dict(budgets=[16, 64, 16]), "repeats a budget"),
        (dict(budget=0), "budget must be >= 1"),
        (dict(budget=0, budgets=[16]), "budget must be >= 1"),
    ],
)
def test_bad_budgets_are_one_clear_error(kw: dict, what: str) -> None:
    with pytest.raises(UserInputError, match=what) as err:
        _callback(**kw)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------ real decoding
@needs_small
def test_each_curve_point_is_a_real_decode_at_that_budget() -> None:
    """On the trained toy head every point equals SpeculativeGenerator at that budget on the same prompts,
    tau grows with the budget, and the tokens do not depend on the budget (lossless)."""
    from jetflow_pl.checkpoints import load_draft_head
    from jetflow_pl.decoding import SpeculativeGenerator
    from jetflow_pl.runtime.torch_backend import TorchBackend
    from jetflow_pl.target import TargetModel

    target = TargetModel.from_pretrained(SMALL)
    head = load_draft_head(data_gen.toy.SMALL_HEAD_DIR)
    module = SimpleNamespace(hparams=SimpleNamespace(target_path=str(SMALL)), target=target, head=head)
    cb = AcceptanceLengthCallback(
        prompts_file=str(DEFAULT_DIR / "math.jsonl"),
        num_prompts=3,
        budget=16,
        budgets=[16, 64, 256],
        max_new_tokens=48,
    )
    stats = cb.measure(module)
    assert sorted(stats["curve"]) == [16, 64, 256]
    assert stats["tau"] == stats["curve"][16]["tau"] and stats["rounds"] == stats["curve"][16]["rounds"]

    prompts = cb._load_prompts(module)
    backend = TorchBackend(target, head)
    tokens = {}
    for k in (16, 64, 256):
        gen = SpeculativeGenerator(backend, k, cb.width, eos_token_id=cb._eos)
        results = [gen.generate(p, cb.max_new_tokens) for p in prompts]
        lengths = [n for r in results for n in r.accept_lengths]
        tokens[k] = [r.tokens for r in results]
        point = stats["curve"][k]
        # the same decoder, head, prompts and thread count in one process: the same integer accept lengths
        assert (point["rounds"], point["tokens"]) == (len(lengths), sum(map(len, tokens[k])))
        assert point["tau"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-12)
    assert tokens[16] == tokens[64] == tokens[256]
    taus = [stats["curve"][k]["tau"] for k in (16, 64, 256)]
    # the shipped head accepts long drafts on held-out math, and each 4x larger tree holds candidates the
    # smaller one lacks: 3.20 / 4.16 / 4.78 here (3.20 / 4.38 / 4.91 on all 20 prompts at 128 tokens),
    # margins of 0.6+ tokens per round, far beyond any rounding effect; a flat or falling curve means the
    # points were decoded at the wrong budgets
    assert taus[0] > 1.5 and taus[0] < taus[1] < taus[2]


# ------------------------------------------------------------------------------------------ in a fit
def _random_dataset(root: Path) -> Path:
    from datasets import Dataset

    docs = random_rows(40, VOCAB, prompt_len=(3, 8), response_len=(8, 20), domains=("math",))
    Dataset.from_list(docs).save_to_disk(str(root / "dataset"))
    return root


def _fit(target_dir: Path, root: Path, max_steps: int, callbacks: list) -> Trainer:
    module = DistillationModule(
        target_path=str(target_dir), block_size=4, mask_token_id=2, num_anchors=4, lr=1e-3, warmup_steps=1
    )
    data = DistillDataModule(
        dataset_path=str(_random_dataset(root)), seq_len=64, batch_size=2, val_fraction=0.1, max_val_rows=2
    )
    trainer = Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(str(root), name="logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(root),
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data)
    return trainer


def test_the_curve_is_logged_and_exported_by_a_curve_point(
    tiny_target_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tau_cb = _callback(every_n_steps=2, budget=4, budgets=[2, 4, 8])
    export = HFHeadExport(str(tmp_path / "head"), monitor="val/tau@8")
    with caplog.at_level(logging.INFO):
        trainer = _fit(tiny_target_dir, tmp_path, 2, [tau_cb, export])
    names = ["val/tau", "val/tau@2", "val/tau@4", "val/tau@8"]
    last = tau_cb.history[-1]
    for name, k in zip(names, [4, 2, 4, 8], strict=True):
        assert float(trainer.callback_metrics[name]) == pytest.approx(last["curve"][k]["tau"])
    assert all(last["curve"][k]["tau"] >= 1.0 for k in (2, 4, 8))  # every round commits >= 1 token
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = {name: [float(r[name]) for r in rows if r.get(name)] for name in names}
    assert all(logged[name] for name in names), logged
    assert logged["val/tau@8"][-1] == pytest.approx(last["curve"][8]["tau"])
    # the log line shows the whole curve
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("[val/tau] step 2"))
    assert "tau by budget {2: " in line and ", 4: " in line and ", 8: " in line
    info = json.loads((tmp_path / "head" / "best" / "export_info.json").read_text())
    assert info["monitor"] == "val/tau@8" and info["value"] == pytest.approx(last["curve"][8]["tau"])


class ScriptedCurve(AcceptanceLengthCallback):
    """The real callback with its decoder replaced by a scripted curve per step, so the test knows which
    step is best at which budget (with real decoding on a random head every point is ~1)."""

    CURVES = {1: {16: 2.0, 64: 3.0}, 2: {16: 2.5, 64: 2.9}, 3: {16: 2.4, 64: 3.5}}

    def measure(self, pl_module) -> dict:
        curve = {
            k: {"tau": t, "rounds": 1, "tokens": 1, "seconds": 0.0}
            for k, t in self.CURVES[self._step].items()
        }
        return {"tau": curve[self.budget]["tau"], "rounds": 1, "tokens": 1, "seconds": 0.0, "curve": curve}

    def _run(self, trainer, pl_module) -> None:
        self._step = trainer.global_step
        super()._run(trainer, pl_module)


@pytest.mark.parametrize(
    ("monitor", "step", "value"),
    [("val/tau@16", 2, 2.5), ("val/tau@64", 3, 3.5), ("val/tau", 3, 3.5)],  # val/tau: the main budget, 64
)
def test_export_best_selects_by_the_monitored_curve_point(
    tiny_target_dir: Path, tmp_path: Path, monitor: str, step: int, value: float
) -> None:
    tau_cb = ScriptedCurve(
        every_n_steps=1, at_train_end=False, budget=64, budgets=[16, 64], prompt_token_ids=PROMPTS
    )
    export = HFHeadExport(str(tmp_path / "head"), monitor=monitor, save_last=False)
    _fit(tiny_target_dir, tmp_path, 3, [tau_cb, export])
    assert (export.best_step, export.best_value) == (step, value)
    info = json.loads((export.best_dir / "export_info.json").read_text())
    assert info == {"global_step": step, "monitor": monitor, "value": value}


def test_monitoring_a_budget_that_is_not_measured_fails_before_training(
    tiny_target_dir: Path, tmp_path: Path
) -> None:
    tau_cb = _callback(every_n_steps=1, budgets=[16, 64])
    export = HFHeadExport(str(tmp_path / "head"), monitor="val/tau@32")
    with pytest.raises(UserInputError, match=r"monitors val/tau@32, which .* never logs") as err:
        _fit(tiny_target_dir, tmp_path, 1, [tau_cb, export])
    assert "\n" not in str(err.value) and "val/tau@64" in str(err.value)
    assert tau_cb.history == [] and not (tmp_path / "head").exists()
