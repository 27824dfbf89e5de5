"""Crashes (issue 9): a run killed with SIGKILL at a random point, or stopped by a full disk, resumes
to exactly the result of an uninterrupted run.

The killed runs are the real `python -m jetflow_pl predict|fit --config ...` commands in a subprocess;
the uninterrupted reference runs and the reruns go through the same CLI entry point in-process (the same
code path without paying a second interpreter start-up each). Tiny seeded models, CPU, fp32.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fake_rows import random_rows
from regen_configs import predict_run_config

from data_gen.regenerate import writer as writer_mod
from data_gen.regenerate.writer import list_shards, shard_ids
from jetflow_pl.cli import main as cli_main

pytestmark = [
    pytest.mark.filterwarnings("ignore:Couldn.t infer the batch indices"),
    pytest.mark.filterwarnings("ignore:LightningCLI's args parameter"),
    pytest.mark.usefixtures("one_thread"),
]

REPO = Path(__file__).resolve().parents[1]
SMALL = REPO / "data_gen" / "toy" / "assets" / "small"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SOURCE = "toy:math:heldout:24"  # 24 samples -> 12 shards of 2
MAX_NEW = 16


def _popen(config: Path, sub: str, cwd: Path, extra: list[str] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jetflow_pl", sub, "--config", str(config), *extra]
    return subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _kill_when(proc: subprocess.Popen, ready, rng: random.Random, max_extra_s: float, timeout: float = 600):
    """SIGKILL `proc` a random moment after `ready()` first holds; True if it was still running."""
    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, max_extra_s))
    alive = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if not alive:
        assert proc.returncode == 0, proc.stderr.read().decode()[-3000:]
    return alive


# ---------------------------------------------------------------------------------------------- regeneration
@pytest.fixture(scope="module")
def regen_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy `tiny` preset, random-init with a wide init range so greedy outputs vary token to token."""
    if not (SMALL / "tokenizer.json").is_file():
        pytest.skip(f"the shipped toy tokenizer is missing at {SMALL}")
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from data_gen.toy.target_trainer import make_config

    torch.manual_seed(0)
    cfg = make_config("tiny", len(AutoTokenizer.from_pretrained(SMALL)), max_position_embeddings=256)
    cfg.initializer_range = 0.3
    model = Qwen3ForCausalLM(cfg).float().eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    out = tmp_path_factory.mktemp("crash_target")
    model.save_pretrained(out, safe_serialization=True)
    return out


def regen_config(tmp: Path, out: Path, target: Path) -> Path:
    args = {"target_path": str(target), "tokenizer_path": str(SMALL), "max_new_tokens": MAX_NEW}
    cfg = predict_run_config(tmp, out, args, SOURCE)
    path = tmp / f"{out.name}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def dataset_rows(out: Path) -> dict[str, dict]:
    import datasets

    return {r["id"]: r for r in datasets.load_from_disk(str(out / "dataset"))}


@pytest.fixture(scope="module")
def regen_reference(tmp_path_factory, regen_target) -> dict[str, dict]:
    """The uninterrupted run's merged dataset."""
    tmp = tmp_path_factory.mktemp("regen_ref")
    cli_main(["predict", "--config", str(regen_config(tmp, tmp / "ref", regen_target))])
    rows = dataset_rows(tmp / "ref")
    assert len(rows) == 24
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regeneration_sigkill_at_a_random_point_resumes_to_identical_rows(
    tmp_path, regen_target, regen_reference, seed
):
    rng = random.Random(seed)
    out = tmp_path / "out"
    config = regen_config(tmp_path, out, regen_target)
    # 0: kill during set-up/the first batch; else after that many shards. At least 6 of the 12 shards are
    # still to generate when the kill lands, so even an idle fast machine is killed mid-run
    after_shards = rng.randint(0, 6)
    proc = _popen(config, "predict", tmp_path)
    if after_shards == 0:
        ready = (out / "run.json").is_file
    else:
        ready = lambda: len(list_shards(out)) >= after_shards  # noqa: E731
    assert _kill_when(proc, ready, rng, max_extra_s=0.05), "the run finished before the kill"
    assert not (out / "dataset").exists()  # the kill landed mid-run
    survivors = list_shards(out)
    for p in survivors:
        assert len(shard_ids(p)) == 2  # every shard on disk is whole, wherever the kill landed
    cli_main(["predict", "--config", str(config)])
    rows = dataset_rows(out)
    assert rows == regen_reference, (
        f"seed {seed}: killed after >= {after_shards} shards ({len(survivors)} kept)"
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_already_done"] == sum(len(shard_ids(p)) for p in survivors)
    assert not list((out / "shards").glob(".tmp-*"))


def test_disk_full_during_a_shard_write_keeps_earlier_shards_and_resumes(
    tmp_path, regen_target, regen_reference, monkeypatch, capsys
):
    """The 3rd shard write fails half-way with ENOSPC: shards 1-2 stay intact, the message says so and
    how to go on, no temp file is left, and the same command afterwards completes the identical dataset."""
    out = tmp_path / "out"
    config = regen_config(tmp_path, out, regen_target)
    real = writer_mod.write_shard_file
    calls = {"n": 0}

    def full_disk(rows, path: Path) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            path.write_bytes(b"PAR1 half a shard")  # what a write cut short by ENOSPC leaves
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(rows, path)

    monkeypatch.setattr(writer_mod, "write_shard_file", full_disk)
    with pytest.raises(SystemExit) as info:
        cli_main(["predict", "--config", str(config)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "disk full while writing shard shard-r00000-" in line
    assert "the 2 shard(s) written before it are intact and its 2 rows were not written" in line
    assert "free space and rerun the same command to resume" in line
    kept = list_shards(out)
    assert len(kept) == 2 and all(len(shard_ids(p)) == 2 for p in kept)
    assert not list((out / "shards").glob(".tmp-*")) and not (out / "dataset").exists()
    monkeypatch.setattr(writer_mod, "write_shard_file", real)  # space freed
    cli_main(["predict", "--config", str(config)])
    assert dataset_rows(out) == regen_reference
    assert json.loads((out / "summary.json").read_text())["skipped_already_done"] == 4


def test_disk_full_during_the_final_merge_keeps_every_shard_and_a_rerun_only_merges(
    tmp_path, regen_target, regen_reference, monkeypatch, capsys
):
    out = tmp_path / "out"
    config = regen_config(tmp_path, out, regen_target)
    real = writer_mod.merge_shards

    def full_disk(path: Path) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path / "dataset"))

    monkeypatch.setattr(writer_mod, "merge_shards", full_disk)
    with pytest.raises(SystemExit) as info:
        cli_main(["predict", "--config", str(config)])
    assert info.value.code == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert f"disk full while merging {out / 'dataset'}" in line and "every shard in" in line
    assert sum(len(shard_ids(p)) for p in list_shards(out)) == len(regen_reference)
    monkeypatch.setattr(writer_mod, "merge_shards", real)
    cli_main(["predict", "--config", str(config)])
    assert dataset_rows(out) == regen_reference
    assert json.loads((out / "summary.json").read_text())["written"] == 0  # nothing regenerated


# ---------------------------------------------------------------------------------------------- training
TRAIN_STEPS = 24  # killed by step 12, so >= 12 steps (each checkpointed) remain: mid-run on any machine


@pytest.fixture(scope="module")
def distill_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random token documents in the regeneration schema (ids 3..95 of the tiny target's vocab of 96)."""
    from datasets import Dataset

    docs = random_rows(60, 96, domains=("math",))
    root = tmp_path_factory.mktemp("distill_data")
    Dataset.from_list(docs).save_to_disk(str(root / "dataset"))
    return root


def fit_config(tmp: Path, name: str, target: Path, data: Path) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "precision": "32-true",
            "max_steps": TRAIN_STEPS,
            "max_epochs": -1,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            "limit_val_batches": 0,
            "default_root_dir": str(tmp / name),
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {
                        "dirpath": str(tmp / name / "ckpt"),
                        "every_n_train_steps": 1,
                        "save_top_k": -1,
                        "save_last": True,
                    },
                }
            ],
        },
        "model": {
            "class_path": "jetflow_pl.training.module.DistillationModule",
            "init_args": {
                "target_path": str(target),
                "block_size": 4,
                "mask_token_id": 2,
                "num_anchors": 4,
                "lr": 0.001,
                "warmup_steps": 1,
                "seed": 0,
            },
        },
        "data": {
            "class_path": "jetflow_pl.training.data.DistillDataModule",
            "init_args": {
                "dataset_path": str(data),
                "seq_len": 64,
                "batch_size": 2,
                "val_fraction": 0.1,
                "max_val_rows": 2,
            },
        },
    }
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(cfg))
    return path


def final_head(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Head weights of the run's final checkpoint (loaded with weights_only=True: no pickle code)."""
    ckpt = torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == TRAIN_STEPS
    return ckpt["state_dict"]


@pytest.fixture(scope="module")
def train_reference(tmp_path_factory, tiny_target_dir, distill_dataset) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("train_ref")
    cli_main(["fit", "--config", str(fit_config(tmp, "ref", tiny_target_dir, distill_dataset))])
    return final_head(tmp / "ref" / "ckpt")


@pytest.mark.parametrize("seed", [0, 1])
def test_training_sigkill_then_resume_from_last_checkpoint_reaches_the_same_head(
    tmp_path, tiny_target_dir, distill_dataset, train_reference, seed
):
    rng = random.Random(100 + seed)
    config = fit_config(tmp_path, "run", tiny_target_dir, distill_dataset)
    ckpt_dir = tmp_path / "run" / "ckpt"
    after_steps = rng.randint(1, TRAIN_STEPS // 2)

    def ready() -> bool:
        return (
            any(f"step={after_steps}." in p.name for p in ckpt_dir.glob("*.ckpt"))
            if ckpt_dir.is_dir()
            else False
        )

    proc = _popen(config, "fit", tmp_path)
    assert _kill_when(proc, ready, rng, max_extra_s=0.05), "the run finished before the kill"
    saved = sorted(ckpt_dir.glob("*.ckpt"))
    assert saved, "killed before the first checkpoint"
    steps = [torch.load(p, map_location="cpu", weights_only=True)["global_step"] for p in saved]
    assert max(steps) < TRAIN_STEPS, steps  # killed mid-run; every checkpoint on disk loads whole
    cli_main(["fit", "--config", str(config), "--ckpt_path", "last"])
    resumed = final_head(ckpt_dir)
    assert resumed.keys() == train_reference.keys()
    diffs = {k: float((resumed[k] - train_reference[k]).abs().max()) for k in resumed}
    assert max(diffs.values()) <= 1e-6, (seed, after_steps, diffs)
