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


def test_bench_batching_smoke_without_warmup(tmp_path):
    from bench import batching

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
        for batch, cell in row.items():
            assert cell["tokens_per_s"] > 0 and len(cell["tokens_per_s_repeats"]) == 1
            played = cell["budgets_played"]
            # 3 requests through 1 or 2 slots: the last one joins a running batch, so a steady part exists
            assert (
                len(cell["steady_tokens_per_s_repeats"]) == 1 and cell["steady_tokens_per_s_repeats"][0] > 0
            )
            assert 0 < cell["prefill_share"] < 1
            assert 1.0 <= cell["occupancy"] <= int(batch)  # a round decodes at least one request, at most B
            if budget == "0":
                assert set(played) == {"0"} and cell["speedup_vs_ar"] == 1.0
                assert cell["speedup_vs_ar_repeats"] == [1.0] == cell["steady_speedup_vs_ar_repeats"]
            elif budget == "4":
                assert set(played) == {"4"}
    assert set(res["auto_cost_view"]) == {"1", "2"}
    assert res["order_per_repeat"] == [["0", "4", "auto"]]  # the first repeat starts at AR


def test_run_order_puts_every_configuration_once_in_every_position():
    """Over as many repeats as configurations, each one runs first once, last once, ...: a drift within a
    repeat (load building, a process warming up) cannot always favour the same configuration."""
    from bench.batching import run_order

    configs = ["0", "4", "16", "auto"]
    orders = [run_order(configs, rep) for rep in range(8)]
    assert all(sorted(o) == sorted(configs) for o in orders)
    for position in range(len(configs)):
        assert sorted(o[position] for o in orders[:4]) == sorted(configs)
    assert orders[4:] == orders[:4] and orders[1] == ["4", "16", "auto", "0"]


def test_require_lossless_names_the_requests_that_differ_from_ar():
    """The benches' one lossless check (batching, engine_ab, round_patterns): equal tokens pass, and a run
    whose request 1 differs stops the bench naming that request and the run."""
    from bench.batching import require_lossless

    ar = {0: [5, 6], 1: [7, 8]}
    require_lossless({0: [5, 6], 1: [7, 8]}, ar, "budget 4, batch 2")
    with pytest.raises(SystemExit, match=r"budget 4, batch 2: requests \[1\] differ from AR"):
        require_lossless({0: [5, 6], 1: [7, 9]}, ar, "budget 4, batch 2")


def test_closed_loop_has_no_steady_part_when_every_request_fits_the_first_batch():
    """All requests in the first batch: the loop is ramp and drain only, so no steady throughput is
    claimed; AR keeps both requests in every round (equal lengths, no EOS this early: occupancy 2)."""
    from bench import batching
    from jetflow_pl.decoding import SpeculativeGenerator
    from jetflow_pl.head import DraftHead
    from jetflow_pl.runtime.torch_backend import TorchBackend
    from jetflow_pl.target import TargetModel

    head = DraftHead.from_pretrained(str(HEAD)).eval()
    target = TargetModel.from_pretrained(SMALL, head.config.target_layer_ids)
    gen = SpeculativeGenerator(TorchBackend(target, head, max_batch=2), 0, 4)
    level = batching.closed_loop(gen, 2, [[5, 6, 7], [8, 9]], 2, 3)
    assert level["steady_tokens_per_s"] is None and level["steady_share"] is None
    assert level["tokens"] == 6 and level["occupancy"] == 2.0


def test_bench_batching_refuses_a_run_with_no_timed_request(tmp_path):
    from bench import batching

    with pytest.raises(SystemExit) as refused:
        batching.main(["--requests", "0", "--out", str(tmp_path / "x.json")])
    assert refused.value.code == 2  # argparse's usage error, before any model is loaded


def test_engine_ab_compares_engine_dirs_side_by_side(tmp_path):
    """bench/engine_ab.py on two copies of one batched toy engine: every cell is measured for both, the
    ratio is to the first, and identical graphs give identical tokens (0 requests differ)."""
    import shutil

    from bench import engine_ab
    from export.onnx_export import ExportSettings, export_engine

    first = export_engine(ExportSettings(head=HEAD, target=SMALL, out=tmp_path / "a", max_batch=2))
    second = Path(shutil.copytree(first, tmp_path / "b"))
    out = tmp_path / "ab.json"
    argv = ["--engine-dirs", str(first), str(second), "--batch", "1", "2", "--budgets", "4"]
    argv += "--requests 2 --warmup 0 --max-tokens 6 --n-prompts 2 --threads 1 --repeats 1".split()
    argv += ["--prompts", str(REPO / "data_gen/toy/assets/heldout_prompts/math.jsonl"), "--out", str(out)]
    assert engine_ab.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["requests_differing_from_first_engine_at_budget_0"] == {str(first): 0, str(second): 0}
    assert set(res["results"]) == {str(first), str(second)}
    for name, cells in res["results"].items():
        assert set(cells) == {"1", "2"}
        for row in cells.values():
            assert set(row) == {"0", "4"}  # the AR reference is added when not asked for
            for cell in row.values():
                assert cell["tokens_per_s"] > 0 and len(cell["tokens_per_s_repeats"]) == 1
                assert cell["vs_first_engine"] == 1.0 if name == str(first) else cell["vs_first_engine"] > 0
    with pytest.raises(SystemExit) as refused:  # the same directory twice would merge two columns
        engine_ab.main(["--engine-dirs", str(first), str(first), "--out", str(out)])
    assert refused.value.code == 2


def test_round_patterns_times_each_budget_of_the_pattern_and_stays_lossless(tmp_path):
    """bench/round_patterns.py on the toy pair: each pattern plays exactly its budgets (alt: AR and 1 in
    turn, so their round counts differ by at most one), every request's tokens equal AR's (the bench would
    stop otherwise), and the summary holds a round median for every budget played."""
    from bench import round_patterns

    out = tmp_path / "r.json"
    argv = ["--target", str(SMALL), "--head", str(HEAD), "--batch", "2", "--max-tokens", "12"]
    argv += ["--prompts", str(REPO / "data_gen/toy/assets/heldout_prompts/math.jsonl"), "--n-prompts", "2"]
    argv += ["--repeats", "1", "--patterns", "steady1", "alt", "--out", str(out)]
    assert round_patterns.main(argv) == 0
    res = json.loads(out.read_text())
    assert list(res["runs"]) == ["ar", "steady1", "alt"]  # the AR reference is added first
    played = {name: waves[0]["rounds"] for name, waves in res["runs"].items()}
    assert set(played["ar"]) == {"0"} and set(played["steady1"]) == {"1"}
    assert set(played["alt"]) == {"0", "1"}
    assert played["alt"]["0"]["rounds"] - played["alt"]["1"]["rounds"] in (0, 1)  # AR first, then turns
    # lossless: every pattern decodes the same tokens, so the same count
    assert (
        len({waves[0]["tokens"] for waves in res["runs"].values()}) == 1
        and res["runs"]["ar"][0]["tokens"] > 2
    )
    for name in res["runs"]:
        assert set(res["summary"][name]["round_median_ms"]) == set(played[name])


def test_pattern_budget_cycles_its_pattern():
    from bench.round_patterns import PatternBudget
    from jetflow_pl.decoding.budget import RoundInfo

    pol = PatternBudget([0, 0, 1])
    assert pol.max_budget == 1 and [pol.choose(RoundInfo()) for _ in range(7)] == [0, 0, 1, 0, 0, 1, 0]
