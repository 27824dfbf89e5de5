"""Bad input to `python -m jetflow_pl fit` fails before training with ONE `error:` line (exit status 2), and
a run whose loss or teacher logits turn NaN/inf stops with a message naming the global step.

The CLI cases run `jetflow_pl.cli.main` in-process (the same code path as the command, without paying an
interpreter start per case); one case also runs the real `python -m jetflow_pl` subprocess.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback
from test_distill_module import MASK_ID, VOCAB, _data, _module, _random_docs, _trainer

from jetflow_pl.cli import main as cli_main
from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.training.module import NonFiniteLossError

REPO = Path(__file__).resolve().parents[1]


def _save_docs(docs: list[dict], out: Path) -> Path:
    from datasets import Dataset

    Dataset.from_list(docs).save_to_disk(str(out))
    return out


@pytest.fixture(scope="module")
def good_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_docs(_random_docs(24), tmp_path_factory.mktemp("good") / "dataset")


def _fit_config(
    tmp: Path, target: Path, dataset: Path, model: dict | None = None, data: dict | None = None
) -> Path:
    """A complete fit config for the tiny target (1 step, no logger/checkpoints)."""
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 1,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "default_root_dir": str(tmp / "root"),
        },
        "model": {
            "class_path": "jetflow_pl.training.module.DistillationModule",
            "init_args": {
                "target_path": str(target),
                "block_size": 4,
                "mask_token_id": MASK_ID,
                "num_anchors": 4,
                **(model or {}),
            },
        },
        "data": {
            "class_path": "jetflow_pl.training.data.DistillDataModule",
            "init_args": {
                "dataset_path": str(dataset),
                "seq_len": 64,
                "batch_size": 2,
                "val_fraction": 0.0,
                **(data or {}),
            },
        },
    }
    path = tmp / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run_cli(config: Path, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", str(config)])
    return int(exc.value.code), capsys.readouterr().err


def _head_for(target_dir: Path, out: Path, **changes) -> Path:
    """A saved head built for a copy of the target config with `changes` (a head that does not fit)."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(str(target_dir))
    for k, v in changes.items():
        setattr(tc, k, v)
    DraftHead(DraftHeadConfig.for_target(tc, block_size=4, mask_token_id=MASK_ID)).save_pretrained(str(out))
    return out


def _no_response_docs() -> list[dict]:
    docs = _random_docs(12)
    for d in docs:
        d["loss_mask"] = [0] * len(d["loss_mask"])
    return docs


def _short_response_docs() -> list[dict]:
    """Responses of 2 tokens: no block of 4 fits inside a response's document."""
    docs = _random_docs(12)
    for d in docs:
        d["input_ids"] = d["input_ids"][: d["prompt_len"] + 2]
        d["loss_mask"] = [0] * d["prompt_len"] + [1, 1]
    return docs


def _mask_in_data_docs() -> list[dict]:
    """One response holds the MASK id itself: the head could not tell "predict here" from that token."""
    docs = _random_docs(12)
    docs[5]["input_ids"][docs[5]["prompt_len"] + 1] = MASK_ID
    return docs


CASES = {
    "block_size_1": ({"block_size": 1}, None, None, "block_size must be >= 2"),
    "mask_is_pad": ({"mask_token_id": 0}, None, None, "equals the target's pad_token_id"),
    "mask_is_eos": ({"mask_token_id": 1}, None, None, "equals the target's eos_token_id"),
    "mask_outside_vocab": ({"mask_token_id": VOCAB + 4}, None, None, "mask_token_id: 100 is not a token id"),
    "mask_negative": ({"mask_token_id": -1}, None, None, "is not a token id"),
    "layer_out_of_range": ({"target_layer_ids": [0, 7]}, None, None, "target_layer_ids"),
    "head_hidden_mismatch": ("head:hidden_size", None, None, "hidden_size"),
    "head_vocab_mismatch": ("head:vocab_size", None, None, "vocab_size"),
    "no_response_tokens": (None, _no_response_docs, None, "no response tokens"),
    "responses_shorter_than_block": (None, _short_response_docs, None, "no anchor position"),
    "mask_in_data": (None, _mask_in_data_docs, None, f"mask_token_id {MASK_ID} occurs in the training data"),
    "dataset_missing": (None, None, {"dataset_path": "/nonexistent/regen"}, "does not exist"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_error_line_before_training(
    case: str, tiny_target_dir: Path, good_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    model, make_docs, data, expected = CASES[case]
    if isinstance(model, str):  # a saved head built for a different target
        field = model.split(":")[1]
        from transformers import AutoConfig

        value = 2 * int(getattr(AutoConfig.from_pretrained(str(tiny_target_dir)), field))
        model = {"init_head_path": str(_head_for(tiny_target_dir, tmp_path / "head", **{field: value}))}
    dataset = _save_docs(make_docs(), tmp_path / "ds") if make_docs else good_dataset
    config = _fit_config(tmp_path, tiny_target_dir, dataset, model, data)
    code, err = _run_cli(config, capsys)
    assert code == 2, err[-2000:]
    assert "Traceback" not in err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, err[-2000:]
    assert expected in errors[0], errors[0]


def test_good_config_trains_through_the_same_path(
    tiny_target_dir: Path, good_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The control case: the config the error cases mutate is valid and trains its one step."""
    cli_main(["fit", "--config", str(_fit_config(tmp_path, tiny_target_dir, good_dataset))])
    assert "error:" not in capsys.readouterr().err


def test_cli_subprocess_exit_status_and_one_line(
    tiny_target_dir: Path, good_dataset: Path, tmp_path: Path
) -> None:
    config = _fit_config(tmp_path, tiny_target_dir, good_dataset, {"block_size": 1})
    out = subprocess.run(
        [sys.executable, "-m", "jetflow_pl", "fit", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "block_size must be >= 2" in errors[0]


# ------------------------------------------------------------------------------------------ non-finite
class Poison(Callback):
    """At `step`, fills a tensor (chosen by `pick(pl_module)`) with `value` before the training step."""

    def __init__(self, step: int, pick, value: float = float("nan")) -> None:
        self.step, self.pick, self.value = step, pick, value

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                self.pick(pl_module).fill_(self.value)


def test_nan_loss_stops_the_run_naming_the_step(
    tiny_target_dir: Path, good_dataset: Path, tmp_path: Path
) -> None:
    module = _module(tiny_target_dir)
    poison = Poison(2, lambda m: m.head.fc.weight)
    trainer = _trainer(tmp_path, 5, [poison])
    with pytest.raises(NonFiniteLossError, match=r"non-finite training loss \(nan\) at global step 2 "):
        trainer.fit(module, datamodule=_data(good_dataset))
    assert trainer.global_step == 2  # the bad step's update never ran


def test_inf_loss_is_caught_too(
    tiny_target_dir: Path, good_dataset: Path, tmp_path: Path, monkeypatch
) -> None:
    """A loss that is +inf (here: a monkeypatched distill_step) is stopped like a NaN."""
    import jetflow_pl.training.module as mod

    real = mod.distill_step

    def inf_at_step_1(*args, **kwargs):
        out = real(*args, **kwargs)
        if module.global_step == 1:
            out["loss"] = out["loss"] + float("inf")
        return out

    monkeypatch.setattr(mod, "distill_step", inf_at_step_1)
    module = _module(tiny_target_dir)
    with pytest.raises(NonFiniteLossError, match=r"\(inf\) at global step 1 "):
        _trainer(tmp_path, 4).fit(module, datamodule=_data(good_dataset))


def test_nonfinite_teacher_raises_naming_the_step(
    tiny_target_dir: Path, good_dataset: Path, tmp_path: Path
) -> None:
    # the target's final norm feeds only the teacher when the head taps layer 0 (the tap of the last
    # layer is the final-normed hidden state)
    poison = Poison(1, lambda m: m.target.final_norm.weight, float("inf"))
    trainer = _trainer(tmp_path, 4, [poison])
    with pytest.raises(NonFiniteLossError, match=r"non-finite teacher logits at global step 1 "):
        trainer.fit(_module(tiny_target_dir, target_layer_ids=[0]), datamodule=_data(good_dataset))


def test_nonfinite_teacher_skip_keeps_the_head_finite(
    tiny_target_dir: Path, good_dataset: Path, tmp_path: Path
) -> None:
    poison = Poison(1, lambda m: m.target.final_norm.weight, float("inf"))
    module = _module(tiny_target_dir, target_layer_ids=[0], on_nonfinite_teacher="skip")
    trainer = _trainer(tmp_path, 3, [poison])
    with pytest.warns(UserWarning, match=r"non-finite teacher logits at global step 1 .*dropped"):
        trainer.fit(module, datamodule=_data(good_dataset))
    assert trainer.global_step == 3
    assert all(torch.isfinite(p).all() for p in module.head.parameters())
    assert float(trainer.callback_metrics["train/teacher_nonfinite"]) > 0


def test_chunked_loss_skip_drops_only_bad_rows() -> None:
    """With `skip_nonfinite_teacher` a NaN teacher row gets weight 0: the loss equals the loss of the
    remaining rows and its gradient is finite; without it the loss is NaN."""
    from jetflow_pl.training.losses import chunked_kl_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 32, bias=False)
    student = torch.randn(6, 8, requires_grad=True)
    teacher = torch.randn(6, 8)
    teacher[2, 3] = float("nan")
    loss, stats = chunked_kl_loss(student, teacher, head, chunk_size=4, skip_nonfinite_teacher=True)
    keep = torch.tensor([0, 1, 3, 4, 5])
    ref, _ = chunked_kl_loss(student[keep].detach(), teacher[keep], head, chunk_size=4)
    assert int(stats["teacher_nonfinite"]) == 1
    assert torch.allclose(loss, ref, atol=1e-6)
    loss.backward()
    assert torch.isfinite(student.grad).all() and student.grad[2].abs().sum() == 0
    bad, stats = chunked_kl_loss(student.detach(), teacher, head, chunk_size=4)
    assert torch.isnan(bad) and int(stats["teacher_nonfinite"]) == 1
