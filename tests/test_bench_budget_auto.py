"""bench/budget_auto.py runs end to end on the shipped toy pair and writes the documented fields
(numbers are not asserted: they are timings; the lossless check inside the bench is)."""

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


def test_bench_budget_auto_smoke(tmp_path, monkeypatch):
    from jetflow_pl.checkpoints import load_draft_head
    from jetflow_pl.decoding.budget.measure_costs import measure_cost_profile
    from jetflow_pl.runtime.torch_backend import TorchBackend
    from jetflow_pl.target import TargetModel

    monkeypatch.setenv("JETFLOW_PL_CACHE_DIR", str(tmp_path / "cache"))
    # a short-ladder profile of the bench's own backend: this test is about the bench, not the timings
    backend = TorchBackend(TargetModel.from_pretrained(SMALL), load_draft_head(HEAD))
    prof = measure_cost_profile(backend, kv_len=64, nodes=(1, 5, 9), repeats=1).save(tmp_path / "cost.json")
    prompts = REPO / "data_gen/toy/assets/heldout_prompts/math.jsonl"
    calib = REPO / "data_gen/toy/assets/heldout_prompts/prose.jsonl"
    from bench import budget_auto

    out = tmp_path / "r.json"
    argv = ["--target", str(SMALL), "--head", str(HEAD), "--prompts", str(prompts), "--n-prompts", "2"]
    argv += ["--max-new-tokens", "12", "--budgets", "4", "8", "--skip-hf", "--cost-profile", str(prof)]
    argv += ["--calibration-prompts", str(calib), "--write-acceptance-profile", str(tmp_path / "prior.json")]
    argv += ["--repeats", "2", "--out", str(out)]
    budget_auto.main(argv)
    res = json.loads(out.read_text())
    assert res["lossless"] is True and res["n_prompts"] == 2 and set(res["fixed"]) == {"4", "8"}
    assert res["repeats"] == 2 and res["ar"]["rounds"] > 0
    for row in [*res["fixed"].values(), res["auto"], res["auto_no_prior"]]:
        reps = row["speedup_vs_ar_repeats"]
        assert len(reps["values"]) == 2 and reps["min"] <= reps["median"] <= reps["max"]
        assert reps["min"] == min(reps["values"]) and reps["max"] == max(reps["values"])
    # pooled over both repeats: the same tokens decoded twice (lossless) by every configuration
    tokens = res["ar"]["tokens"]
    assert tokens % 2 == 0 and 2 * 2 <= tokens <= 2 * 2 * 12
    assert all(row["tokens"] == tokens for row in [*res["fixed"].values(), res["auto"], res["auto_no_prior"]])
    for row in res["fixed"].values():
        assert {
            "tau",
            "decode_tokens_per_s",
            "speedup_vs_ar",
            "ceiling_speedup_vs_ar",
            "fraction_of_ceiling",
        } <= set(row)
    for name in ("auto", "auto_no_prior"):
        row = res[name]
        assert sum(row["budgets_played"].values()) == row["rounds"] > 0
        assert {"predicted_speedup_vs_ar", "best_fixed_budget", "fraction_of_best_fixed"} <= set(row)
    assert (
        res["acceptance_prior"]["from"].startswith("calibrated now") and (tmp_path / "prior.json").is_file()
    )
    assert res["cost_profile"]["source"] == str(prof)
    assert set(res["acceptance_by_budget"]) == {"0", "1", "2", "4", "8"}
    assert budget_auto.DEFAULT_PROMPTS.is_file()
