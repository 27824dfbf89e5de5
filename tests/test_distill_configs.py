"""Every shipped distillation config parses with the real CLI (`fit --print_config`): class paths
resolve, every key is an accepted argument of its class, every value has the declared type. Nothing is
instantiated, so the GPU templates are checked on a CPU machine too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from jetflow_pl.cli import lightning_main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted([REPO / "configs/quickstart.yaml", *(REPO / "configs/distill").glob("*.yaml")])


def test_the_templates_are_all_there() -> None:
    names = {p.name for p in CONFIGS}
    assert {"quickstart.yaml", "gpu_template.yaml", "gpu_template_fsdp.yaml"} <= names


def base_config(path: Path) -> Path | None:
    """The config an overlay is applied on top of (`# base-config: PATH` in its header), else None."""
    match = re.search(r"^# base-config: (\S+)$", path.read_text(), re.MULTILINE)
    return REPO / match.group(1) if match else None


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_parses_with_the_cli(path: Path, capsys: pytest.CaptureFixture) -> None:
    base = base_config(path)
    configs = ["--config", str(path)] if base is None else ["--config", str(base), "--config", str(path)]
    with pytest.raises(SystemExit) as exc:
        lightning_main(["fit", *configs, "--print_config"])
    out = capsys.readouterr()
    assert exc.value.code == 0, out.err[-3000:]
    resolved = yaml.safe_load(out.out)
    assert resolved["model"]["class_path"] == "jetflow_pl.training.module.DistillationModule"
    assert resolved["data"]["class_path"] == "jetflow_pl.training.data.DistillDataModule"
    if base is not None:  # the overlay's own values win over its base's
        overlay = yaml.safe_load(path.read_text())
        for key, value in overlay.get("model", {}).get("init_args", {}).items():
            assert resolved["model"]["init_args"][key] == value, key
        assert resolved["trainer"]["default_root_dir"] == overlay["trainer"]["default_root_dir"]


def test_gpu_templates_bf16_ddp_fsdp_multinode() -> None:
    ddp = yaml.safe_load((REPO / "configs/distill/gpu_template.yaml").read_text())
    fsdp = yaml.safe_load((REPO / "configs/distill/gpu_template_fsdp.yaml").read_text())
    for cfg in (ddp, fsdp):
        assert cfg["trainer"]["precision"] == "bf16-mixed"
        assert cfg["model"]["init_args"]["target_dtype"] == "bfloat16"
        assert "num_nodes" in cfg["trainer"]
    assert ddp["trainer"]["strategy"] == "ddp"
    assert fsdp["trainer"]["strategy"]["class_path"].endswith("FSDPStrategy")
    text = (REPO / "configs/distill/gpu_template.yaml").read_text()
    for var in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "torchrun", "SLURM"):
        assert var in text


def test_quickstart_regenerates_its_data_with_the_shipped_target() -> None:
    cfg = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    data = cfg["data"]["init_args"]
    assert data["dataset_path"] and data["regenerate_config"] == "configs/regenerate/toy.yaml"
    assert (REPO / data["regenerate_config"]).is_file()
    target = data["regenerate_overrides"]["model.init_args.target_path"]
    assert target == cfg["model"]["init_args"]["target_path"] and (REPO / target / "config.json").is_file()
