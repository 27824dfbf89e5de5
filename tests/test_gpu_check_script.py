"""`scripts/gpu_check.py --dry-run` runs end to end on a CPU machine and records why each step is skipped.

The GPU check runs only on lent GPU machines, where a broken orchestrator would waste the loan; this test
keeps its CPU path (argument parsing, environment probe, JSON and table) working on every CI run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"
STEPS = ["cuda_ext_build", "cuda_ext_numerics", "triton_numerics", "timing", "pytest_gpu", "tensorrt_engines"]


def _run(*args: str, tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_dry_run_skips_every_step_with_a_reason(tmp_path: Path) -> None:
    out = tmp_path / "tmp" / "results.json"
    proc = _run("--dry-run", "--out", str(out), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads(out.read_text())
    assert payload["dry_run"] is True and payload["dry_run_reason"]
    assert list(payload["steps"]) == STEPS
    for name, rec in payload["steps"].items():
        assert rec["status"] == "skipped", (name, rec)
        assert isinstance(rec.get("reason"), str) and rec["reason"].strip(), (name, rec)
    assert "torch" in payload["environment"]
    last_lines = proc.stdout.strip().splitlines()
    assert last_lines[-1].startswith("overall: DRY RUN")
    assert all(any(line.startswith(step) for line in last_lines) for step in STEPS)


def test_default_out_is_relative_to_the_working_directory(tmp_path: Path) -> None:
    proc = _run("--dry-run", "--only", "timing", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads((tmp_path / "gpu_check_results" / "results.json").read_text())
    assert payload["steps"]["pytest_gpu"]["reason"] == "not selected by --only"


@pytest.mark.slow
def test_cpu_smoke_runs_the_triton_steps_under_the_interpreter(tmp_path: Path) -> None:
    """The step-process plumbing and the numerics/timing code, on CPU (about 30 s: slow-marked)."""
    pytest.importorskip("triton", reason="triton is not installed")
    out = tmp_path / "smoke.json"
    proc = _run("--cpu-smoke", "--out", str(out), tmp_path=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = json.loads(out.read_text())["steps"]
    assert steps["triton_numerics"]["status"] == "passed", steps["triton_numerics"]
    assert steps["timing"]["status"] == "passed", steps["timing"]
    assert all(row.get("triton_ms", 0) > 0 for row in steps["timing"]["details"]["rows"])
    assert steps["cuda_ext_build"]["status"] == "skipped" and steps["cuda_ext_build"]["reason"]
