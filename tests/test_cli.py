"""Command-line entry points: they start, refuse what they cannot do, and report the DESIGN metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    for sub in ("fit", "validate", "test", "predict"):
        assert sub in out.stdout


def test_export_refuses_instead_of_pretending(tmp_path, capsys):
    out = tmp_path / "engine"
    assert export_main(["--head", "h", "--target", "t", "--out", str(out)]) == 2
    assert "not implemented" in capsys.readouterr().err
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
