"""Command-line entry points: they start, refuse what they cannot do, and report the DESIGN metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import data_gen.toy
from export.cli import main as export_main
from jetflow_pl.generate_cli import main as generate_main

SMALL = Path(data_gen.toy.__file__).parent / "assets" / "small"
needs_small = pytest.mark.skipif(
    not (SMALL / "model.safetensors").is_file(), reason=f"shipped toy target missing at {SMALL}"
)


def test_module_cli_lists_lightning_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "jetflow_pl", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # every subcommand a user has, not only Lightning's four
    for sub in ("fit", "validate", "test", "predict", "generate", "evaluate", "draft-vocab"):
        assert f"\n  {sub} " in out.stdout, sub
    assert "jetflow-export" in out.stdout and "jetflow-serve" in out.stdout


def test_export_with_missing_folders_is_one_error_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "engine"
    assert (
        export_main(["--head", str(tmp_path / "h"), "--target", str(tmp_path / "t"), "--out", str(out)]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: --head") and "is not a directory" in err
    assert not out.exists()


def test_generate_requires_a_prompt(tmp_path, capsys):
    assert generate_main(["--target", str(tmp_path)]) == 2
    assert "at least one --prompt" in capsys.readouterr().err


@needs_small
def test_generate_prints_text_and_metrics(tmp_path, capsys):
    report = tmp_path / "out.json"
    rc = generate_main(
        [
            "--target",
            str(SMALL),
            "--prompt",
            "Ann has 4 bags with 6 apples each. How many apples?",
            "--budget",
            "16",
            "--max-new-tokens",
            "24",
            "--compare",
            "--json",
            str(report),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "tau" in text and "vs AR" in text and "vs HF generate" in text
    (row,) = json.loads(report.read_text())
    assert row["matches_hf_greedy"] is True
    assert row["tau"] >= 1.0 and row["new_tokens"] > 0
    assert row["speedup_vs_ar"] > 0 and row["hf_decode_tokens_per_s"] > 0


def test_bad_input_is_one_line_not_a_traceback(tmp_path):
    """A user error (here: a prompt source that does not exist) exits 2 with one `error:` line."""
    repo = Path(__file__).resolve().parents[1]
    cfg = yaml.safe_load((repo / "configs/regenerate/toy.yaml").read_text())
    cfg["data"]["init_args"]["source"] = str(tmp_path / "missing.jsonl")
    cfg["trainer"]["callbacks"][0]["init_args"]["output_dir"] = str(tmp_path / "out")
    cfg["trainer"]["default_root_dir"] = str(tmp_path / "logs")
    cfg["model"]["init_args"]["target_path"] = str(SMALL)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "jetflow_pl", "predict", "--config", str(tmp_path / "bad.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=repo,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "missing.jsonl" in errors[0]
    assert not (tmp_path / "out").exists()


@needs_small
def test_generate_graph_backend_matches_the_torch_backend(tmp_path, capsys):
    rows = {}
    for backend in ("torch", "graph"):
        report = tmp_path / f"{backend}.json"
        argv = ["--target", str(SMALL), "--head", str(data_gen.toy.SMALL_HEAD_DIR), "--backend", backend]
        argv += ["--prompt", "Ann has 4 bags with 6 apples each. How many apples?", "--budget", "16"]
        assert generate_main([*argv, "--max-new-tokens", "24", "--json", str(report)]) == 0
        (rows[backend],) = json.loads(report.read_text())
    assert rows["graph"]["output"] == rows["torch"]["output"]
    assert rows["graph"]["tau"] == rows["torch"]["tau"] > 1.0


def test_generate_onnxruntime_backend_needs_an_engine_dir(tmp_path, capsys):
    argv = ["--target", str(SMALL), "--prompt", "hi", "--backend", "onnxruntime"]
    assert generate_main(argv) == 2
    assert "error: --backend onnxruntime needs --engine-dir" in capsys.readouterr().err
    assert generate_main([*argv, "--engine-dir", str(tmp_path / "none")]) == 2
    assert "engine directory does not exist" in capsys.readouterr().err
