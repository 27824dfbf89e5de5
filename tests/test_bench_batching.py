"""bench/batching.py runs end to end on the shipped toy pair and writes the documented fields (timings are
not asserted; the bench's own check that every request's tokens equal AR's is what a run proves)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import data_gen.toy

REPO = Path(__file__).resolve().parents[1]
SMALL, HEAD = data_gen.toy.SMALL_TARGET_DIR, data_gen.toy.SMALL_HEAD_DIR
pytestmark = pytest.mark.skipif(
    not (SMALL / "model.safetensors").is_file(), reason=f"no toy target at {SMALL}"
)


def test_bench_batching_smoke_without_warmup(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import batching

    out = tmp_path / "b.json"
    argv = ["--target", str(SMALL), "--head", str(HEAD), "--batch", "1", "2", "--budgets", "4", "auto"]
    argv += "--requests 3 --warmup 0 --max-tokens 6 --n-prompts 3 --threads 1 --repeats 1".split()
    argv += ["--cache-dir", str(tmp_path / "costs"), "--out", str(out)]
    assert batching.main(argv) == 0
    res = json.loads(out.read_text())
    # the AR baseline is added when not asked for: it is the lossless reference
    assert set(res["results"]) == {"0", "4", "auto"}
    for budget, row in res["results"].items():
        assert set(row) == {"1", "2"}
        for cell in row.values():
            assert cell["tokens_per_s"] > 0 and len(cell["tokens_per_s_repeats"]) == 1
            played = cell["budgets_played"]
            if budget == "0":
                assert set(played) == {"0"} and cell["speedup_vs_ar"] == 1.0
            elif budget == "4":
                assert set(played) == {"4"}
    assert set(res["auto_cost_view"]) == {"1", "2"}


def test_bench_batching_refuses_a_run_with_no_timed_request(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import batching

    with pytest.raises(SystemExit) as refused:
        batching.main(["--requests", "0", "--out", str(tmp_path / "x.json")])
    assert refused.value.code == 2  # argparse's usage error, before any model is loaded
