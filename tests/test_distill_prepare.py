"""`DistillDataModule.prepare_data` regenerates a missing dataset with the target (the quickstart path):
the real `python -m jetflow_pl predict` run on the shipped small toy target, renamed into place only when
complete, reused afterwards, and a failed run leaves no dataset behind."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from jetflow_pl.errors import UserInputError
from jetflow_pl.training.data import DistillDataModule, dataset_ready, regeneration_config

REPO = Path(__file__).resolve().parents[1]
SMALL = REPO / "data_gen/toy/assets/small"
TOY = REPO / "configs/regenerate/toy.yaml"


def _overrides(source: str = "toy:math:train:4") -> dict:
    return {
        "data.init_args.source": source,
        "data.init_args.batch_size": 4,
        "model.init_args.target_path": str(SMALL),
        "model.init_args.max_new_tokens": 8,
    }


def _dm(dest: Path, **kw) -> DistillDataModule:
    args = dict(
        dataset_path=str(dest),
        regenerate_config=str(TOY),
        regenerate_overrides=_overrides(),
        seq_len=64,
        batch_size=2,
        val_fraction=0.25,
    )
    args.update(kw)
    return DistillDataModule(**args)


def test_regeneration_config_redirects_the_writer_and_applies_overrides(tmp_path: Path) -> None:
    cfg = regeneration_config(TOY, tmp_path / "out", _overrides("toy:code:train:3"))
    writer = next(c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("RegenerationWriter"))
    assert writer["init_args"]["output_dir"] == str(tmp_path / "out")
    assert cfg["data"]["init_args"]["source"] == "toy:code:train:3"
    assert cfg["model"]["init_args"]["max_new_tokens"] == 8
    assert not (tmp_path / "out").exists()  # building the config writes nothing
    with pytest.raises(UserInputError, match="does not exist"):
        regeneration_config(tmp_path / "missing.yaml", tmp_path / "out", None)
    with pytest.raises(UserInputError, match="not a mapping"):
        regeneration_config(TOY, tmp_path / "out", {"data.init_args.source.x": 1})


def test_prepare_data_regenerates_once_then_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "data"
    dm = _dm(dest)
    dm.prepare_data()
    assert dataset_ready(dest) and (dest / "regenerate.yaml").is_file()
    assert not any(p.name.endswith(".regenerating") for p in tmp_path.iterdir())  # staging removed
    dm.setup("fit")
    stats = dm.stats()
    assert stats["loss_tokens"] > 0 and stats["train_rows"] >= 1

    def boom(*args, **kwargs):
        raise AssertionError("a present dataset must not be regenerated")

    monkeypatch.setattr(subprocess, "run", boom)
    _dm(dest).prepare_data()  # present: no subprocess


def test_failed_regeneration_leaves_no_dataset(tmp_path: Path) -> None:
    dest = tmp_path / "data"
    dm = _dm(dest, regenerate_overrides=_overrides("toy:nosuchdomain:train:4"))
    with pytest.raises(UserInputError, match="exited with status 2"):
        dm.prepare_data()
    assert not dest.exists()


def test_existing_folder_without_dataset_is_refused(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("not a dataset")
    with pytest.raises(UserInputError, match="holds no saved dataset"):
        _dm(tmp_path / "data").prepare_data()
    with pytest.raises(UserInputError, match="needs dataset_path"):
        DistillDataModule(regenerate_config=str(TOY), tokenizer_path=str(SMALL))
