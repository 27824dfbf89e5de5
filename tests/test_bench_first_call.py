"""`python -m bench.first_call` end to end on the toy pair: three real `generate` commands against one fresh
cost-profile cache (numbers are timings and not asserted; what each run measured is)."""

from __future__ import annotations

import json

import pytest

import data_gen.toy
from jetflow_pl.decoding.budget.cost_profile import DEFAULT_REPEATS, QUICK_REPEATS

SMALL, HEAD = data_gen.toy.SMALL_TARGET_DIR, data_gen.toy.SMALL_HEAD_DIR
pytestmark = pytest.mark.skipif(
    not (SMALL / "model.safetensors").is_file(), reason=f"no toy target at {SMALL}"
)


def test_first_call_measures_quick_then_reuses_then_measures_in_full(tmp_path):
    from bench import first_call

    out = tmp_path / "first.json"
    argv = ["--target", str(SMALL), "--head", str(HEAD), "--max-new-tokens", "8", "--threads", "1"]
    assert first_call.main([*argv, "--repeats", "1", "--load", "0", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["passes"]) == {"idle"} and res["command"].startswith("python -m bench.first_call")
    (runs,) = res["passes"]["idle"]
    # the first call measured a quick profile, the second read it back, --measure-costs measured the full one
    assert runs["first"]["profile_repeats"] == QUICK_REPEATS and runs["first"]["measure_s"] > 0
    assert runs["cached"]["measure_s"] == 0 and runs["cached"]["profile_repeats"] == QUICK_REPEATS
    assert (
        runs["measure_costs"]["profile_repeats"] == DEFAULT_REPEATS and runs["measure_costs"]["measure_s"] > 0
    )
    assert res["median"]["idle"]["first"]["wall_s"] == runs["first"]["wall_s"]
