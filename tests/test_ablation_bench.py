"""bench/ablation.py's leak check: the evaluation prompts against what each base config trains on (the raw
toy corpora, or the prompts a regenerated dataset was made from), so a real-target run checks its own
training prompts rather than the toy's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.ablation import check_disjoint, main, merge_results, training_prompt_texts
from data_gen.toy.splits import heldout_prompts, train_records

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "distill"


def test_toy_base_trains_on_its_document_counts():
    base = yaml.safe_load((CONFIGS / "toy_ablation.yaml").read_text())
    counts = base["data"]["init_args"]["documents"]["init_args"]["counts"]
    texts = training_prompt_texts(base)
    # every domain's first and last training record is in the set (the counts are read, not a default)
    for domain, n in counts.items():
        records = train_records(domain, n, 0)
        assert {records[0]["prompt"], records[-1]["prompt"]} <= texts
    assert len(texts) <= sum(counts.values())


def test_real_target_base_reads_the_regeneration_prompts():
    base = yaml.safe_load((CONFIGS / "smollm2_ablation.yaml").read_text())
    regen = yaml.safe_load((CONFIGS.parent / "regenerate" / "smollm2.yaml").read_text())
    source = regen["data"]["init_args"]["source"]  # toy:math+code+prose:train:1600+400+200
    texts = training_prompt_texts(base)
    counts = [int(c) for c in source.split(":")[3].split("+")]
    assert len(texts) <= sum(counts)
    assert train_records("code", counts[1], 0)[-1]["prompt"] in texts
    held = {d: [r["prompt"] for r in heldout_prompts(d, 40)] for d in ("math", "code", "prose")}
    assert check_disjoint(held, texts) == {"math": 0, "code": 0, "prose": 0}


def test_check_disjoint_counts_a_leaked_prompt():
    held = {"math": ["a", "b", "c"], "code": ["d"]}
    assert check_disjoint(held, {"b", "c", "x"}) == {"math": 2, "code": 0}


def _run(head: str, settings: dict, base: str = "configs/distill/smollm2_ablation.yaml") -> dict:
    return {
        "base_config": base,
        "commands": [f"python bench/ablation.py eval --heads {head}"],
        "train": {head: {"steps": 10}},
        "eval_settings": settings,
        "eval": {head: {"math": {"16": [{"tau": 2.0}]}}},
        "prompt_counts": {"math": 1},
    }


def test_merge_folds_heads_run_on_other_cores():
    settings = {"width": 4, "n_prompts": 40}
    merged = merge_results({"base_config": "configs/distill/smollm2_ablation.yaml", "commands": []},
                           [_run("causal_g0", settings), _run("bidir_g0", settings)])  # fmt: skip
    assert set(merged["eval"]) == {"causal_g0", "bidir_g0"} and set(merged["train"]) == set(merged["eval"])
    assert merged["eval_settings"] == settings and merged["prompt_counts"] == {"math": 1}
    assert len(merged["commands"]) == 2
    # a head already in the target is kept, not overwritten by a later run of the same head
    again = _run("causal_g0", settings)
    again["eval"]["causal_g0"]["math"]["16"][0]["tau"] = 9.0
    assert merge_results(merged, [again])["eval"]["causal_g0"]["math"]["16"][0]["tau"] == 2.0


@pytest.mark.parametrize("what", ["settings", "base"])
def test_merge_refuses_a_run_of_another_protocol(what):
    results = merge_results({"base_config": "configs/distill/smollm2_ablation.yaml"},
                            [_run("causal_g0", {"width": 4})])  # fmt: skip
    other = (
        _run("bidir_g0", {"width": 8})
        if what == "settings"
        else _run("bidir_g0", {"width": 4}, base="configs/distill/toy_ablation.yaml")
    )
    with pytest.raises(SystemExit, match="cannot merge"):
        merge_results(results, [other])


def test_refine_refuses_a_results_file_refined_with_other_settings(tmp_path):
    # the refine stage adds heads to a results file; heads refined at another refine factor (or budgets,
    # prompts) would land in one table, so the stage refuses before it loads anything
    out = tmp_path / "results.json"
    settings = {"math": {"budgets": [16], "max_new_tokens": 64}, "refine_factor": 2, "width": 4,
                "n_prompts": 40, "math_first": 20}  # fmt: skip
    out.write_text(json.dumps({"refine_settings": settings, "refine": {"causal_g0": {}}}))
    argv = ["refine", "--out", str(out), "--refine-budgets", "16", "--heads", "bidir_g0"]
    with pytest.raises(SystemExit, match="refined with other settings"):
        main([*argv, "--refine-factor", "3"])
    assert json.loads(out.read_text())["refine_settings"] == settings  # the file is left as it was


def test_tables_print_the_path_ratios_of_the_right_heads():
    # the path table is read by hand into docs/BENCHMARKS.md: each row must be the pair its label names
    # (a swapped pair or budget would still print plausible ratios near 1)
    from bench.ablation import PATH_PAIRS, report, tables_md

    results = json.loads(
        (Path(__file__).resolve().parents[1] / "bench/results/ablation_toy.json").read_text()
    )
    report(results, n_boot=50)
    # the toy has the gamma 0 path pair only: no table may claim a gamma 7 one
    assert set(results["path_ratios"]) == {"gamma0"}
    assert "(gamma7), math tau ratios" not in tables_md(results)
    trained, base = PATH_PAIRS["gamma0"]
    refined = [r["tau"] for r in results["refine"][trained]["math"]["64"]]
    plain = [r["tau"] for r in results["eval"][base]["math"]["64"]]
    assert results["path_ratios"]["gamma0"]["pass_vs_base_plain"]["64"]["ratio"] == sum(refined) / sum(plain)
    row = next(
        line
        for line in tables_md(results).splitlines()
        if line.startswith(f"| {trained} + refine / {base} plain")
    )
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2].startswith(f"{sum(refined) / sum(plain):.3f} [")  # columns @16, @64, @256
    # a gamma 7 path head (here the gamma 0 one's rows under its name) is compared with causal_g7, not
    # with the gamma 0 base: the gamma 7 ratios must move when only causal_g7 changes
    g7_trained, g7_base = PATH_PAIRS["gamma7"]
    results["eval"][g7_trained] = results["eval"][trained]
    results["refine"][g7_trained] = results["refine"][trained]
    report(results, n_boot=50)
    g7_plain = [r["tau"] for r in results["eval"][g7_base]["math"]["64"]]
    ratio = results["path_ratios"]["gamma7"]["pass_vs_base_plain"]["64"]["ratio"]
    assert ratio == sum(refined) / sum(g7_plain) != sum(refined) / sum(plain)
    tables = tables_md(results)
    assert f"| {g7_trained} + refine / {g7_base} plain | " in tables
    # the toy never refined causal_g7: that row is printed empty rather than borrowed from another head
    assert results["path_ratios"]["gamma7"]["refine_trained_vs_base"] == {}
    assert f"| {g7_trained} + refine / {g7_base} + refine |  |  |  |" in tables


def test_tables_print_the_gamma_ratios_of_the_right_heads():
    # gamma 7 / gamma 0 at the same attention: docs/BENCHMARKS.md quotes these rows, so each must be the
    # pair and the domain its label names (causal and bidirectional move alike, so a swapped attention or
    # domain would still print plausible ratios)
    from bench.ablation import GAMMA_PAIRS, report, tables_md

    results = json.loads(
        (Path(__file__).resolve().parents[1] / "bench/results/ablation_toy.json").read_text()
    )
    report(results, n_boot=50)
    tables = tables_md(results).split("\n\n")
    for attention, (g7, g0) in GAMMA_PAIRS.items():
        for domain in ("math", "code"):
            ours = [r["tau"] for r in results["eval"][g7][domain]["16"]]
            theirs = [r["tau"] for r in results["eval"][g0][domain]["16"]]
            expect = sum(ours) / sum(theirs)
            assert results["gamma_ratios"][attention][domain]["16"]["ratio"] == expect
            # each domain's header paragraph is followed by its table
            table = tables[next(i for i, t in enumerate(tables) if t.startswith(f"**{domain}**")) + 1]
            row = next(
                line
                for line in table.splitlines()
                if line.startswith(f"| tau ratio gamma 7 / gamma 0, {attention} ({g7} / {g0}) |")
            )
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert cells[1].startswith(f"{expect:.3f} [")  # the first budget column is @16
    # without a gamma-0 head there is no pairing to print, and no row claiming one
    del results["eval"]["causal_g0"]
    report(results, n_boot=50)
    assert set(results["gamma_ratios"]) == {"bidirectional"}
    tables = tables_md(results)
    assert "gamma 7 / gamma 0, causal" not in tables
    # causal_g0 is still in the refine results: its refine rows print with an empty plain cell, not a crash
    refine_rows = [line for line in tables.splitlines() if line.startswith("| causal_g0 | 16 |")]
    assert len(refine_rows) == 1 and refine_rows[0].split("|")[4].strip() == ""


def test_a_killed_fit_is_reported_and_never_skipped_as_trained(tmp_path, monkeypatch):
    # a fit killed by --fit-timeout can leave a head/last behind (HFHeadExport every_n_steps); the rerun
    # must train again rather than evaluate that partial head as the finished one
    import subprocess

    import bench.ablation as ab

    cfg = {"trainer": {"max_steps": 2400}}
    calls = []

    def fake_fit(cmd, **kw):
        calls.append(cmd)
        last = tmp_path / "h" / "head" / "last"
        last.mkdir(parents=True, exist_ok=True)
        (last / "config.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, 124 if len(calls) == 1 else 0)

    monkeypatch.setattr(ab.subprocess, "run", fake_fit)
    monkeypatch.setitem(ab.HEADS, "h", ("test head", {}))
    with pytest.raises(SystemExit, match="ran past --fit-timeout 60 s"):
        ab.train("h", cfg, tmp_path, 60)
    assert not (tmp_path / "h" / "train.json").exists()
    assert ab.train("h", cfg, tmp_path, 60)["returncode"] == 0  # trained again, not skipped
    assert len(calls) == 2
    assert ab.train("h", cfg, tmp_path, 60)["returncode"] == 0 and len(calls) == 2  # now skipped


def test_a_results_file_describes_its_own_heads_only():
    # `heads` tells a reader what each head in the file is; a head this script knows but the file never
    # trained, evaluated or refined must not be listed as if it were part of the run
    from bench.ablation import describe_heads

    results = {"eval": {"causal_g0": {}}, "refine": {"causal_g7": {}}, "eval_seconds": {}}
    assert set(describe_heads(results, [])) == {"causal_g0", "causal_g7"}
    assert set(describe_heads(results, ["causal_g7_path"])) == {"causal_g0", "causal_g7", "causal_g7_path"}
    assert describe_heads(results, [])["causal_g7"]["changes"]["model.init_args.decay_gamma"] == 7.0
