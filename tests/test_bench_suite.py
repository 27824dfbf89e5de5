"""The benchmark suite end to end in smoke mode: `python -m bench.run_all --quick` writes a complete results JSON
and `bench/plot.py` redraws every figure from that JSON alone.

Run as a subprocess (like a user would) so the suite's own argument parsing, thread settings and imports
are what is tested; `--quick` keeps it to ~1 minute on 2 CPU cores (2 prompts per set, budgets 4 16,
16 new tokens, 1 repeat, no ONNX export or distillation run).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPREAD_KEYS = {"median", "min", "max", "values"}
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def _check_spread(x: dict, what: str) -> None:
    assert SPREAD_KEYS <= set(x), f"{what}: no median/spread: {x}"
    assert x["min"] <= x["median"] <= x["max"], what
    assert x["median"] > 0, f"{what}: {x}"


def _check_block(block: dict, budgets: list[int], heads: set[str], where: str) -> None:
    _check_spread(block["ar"]["decode_tokens_per_s"], f"{where} AR")
    _check_spread(block["hf_generate"]["decode_tokens_per_s"], f"{where} HF generate")
    assert set(block["heads"]) == heads, where
    for head, rows in block["heads"].items():
        assert sorted(int(b) for b in rows) == budgets, (where, head)
        for b, row in rows.items():
            what = f"{where} {head} @{b}"
            assert row["tau"] >= 1.0, what
            assert row["mismatches_vs_ar"] == 0, f"{what}: greedy speculative output differs from AR"
            for key in ("decode_tokens_per_s", "speedup_vs_ar", "speedup_vs_hf"):
                _check_spread(row[key], f"{what} {key}")
            assert sum(row["accept_histogram"].values()) == row["rounds"], what


@pytest.fixture(scope="module")
def quick_suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("suite")
    out, figs = tmp / "suite.json", tmp / "figures"
    cmd = [
        sys.executable,
        "-m",
        "bench.run_all",
        "--quick",
        "--out",
        str(out),
        "--cache-dir",
        str(tmp / "cache"),
    ]
    if HAS_MPL:  # matplotlib is the `bench` extra, not the `test` one: the schema check runs without it
        cmd += ["--plots", str(figs)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), figs


def test_quick_suite_schema(quick_suite: tuple[dict, Path]) -> None:
    r, _ = quick_suite
    assert r["command"].startswith("python -m bench.run_all --quick")
    m = r["machine"]
    for key in ("cpu_model", "cpu_count", "torch", "onnxruntime", "threads", "load_average_at_start"):
        assert m.get(key) is not None, key
    assert m["threads"] == 1
    assert r["git"]["commit"]
    assert r["settings"]["budgets"] == [4, 16] and r["settings"]["repeats"] == 1
    # the bidirectional head exists only where the quickstart_bidir run was trained: else a stated skip
    heads = {"causal", "chain"} | ({"bidirectional"} if "bidirectional" in r["heads"] else set())
    if "bidirectional" not in heads:
        assert "bidirectional" in r["skipped"]
    for domain in ("math", "code", "prose"):
        _check_block(r["decode"][domain], [4, 16], heads, domain)
    ood = r["heldout"]["code_ood"]
    assert "idlelib" in ood["source"] and ood["prompt_ids"]
    _check_block(ood, [4, 16], heads, "code_ood")
    vc = r["verify_cost"]
    assert {1, 17, 65, 257} <= {int(n) for n in vc["ratio"]}
    for n in vc["ratio"]:
        _check_spread(vc["verify_ms"][n], f"verify {n}")
        _check_spread(vc["draft_ms"][n], f"draft {n}")
    assert vc["ratio"]["1"]["median"] == 1.0
    assert r["ceiling"]["16"]["causal"]["ceiling_vs_ar"] > 0
    assert "skipped" in r["ort"]
    for bs, v in r["regenerate"]["tokens_per_s"].items():
        _check_spread(v, f"regenerate batch {bs}")
    assert "skipped" in r["distill"] or "result" in r["distill"]
    assert r["runtime_seconds"] > 0


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib not installed (pip install -e '.[bench]')")
def test_plot_regenerates_pngs_from_json(quick_suite: tuple[dict, Path], tmp_path: Path) -> None:
    r, figs = quick_suite
    names = {"tau_vs_budget.png", "speedup_vs_budget.png", "verify_cost.png", "acceptance_by_depth.png"}
    assert {p.name for p in figs.glob("*.png")} == names  # drawn by run_all.py --plots
    src = tmp_path / "suite.json"
    src.write_text(json.dumps(r))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.plot", str(src), "--out", str(tmp_path / "again"), "--tables"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in names:
        png = tmp_path / "again" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "## README table" in proc.stdout and "| causal |" in proc.stdout
