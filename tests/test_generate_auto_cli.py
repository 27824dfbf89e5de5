"""`generate --budget auto` (the default) end to end on the shipped toy pair, and its one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import data_gen.toy
from jetflow_pl.decoding.budget import AcceptanceProfile
from jetflow_pl.decoding.budget.cost_profile import QUICK_MAX_NODES, CostProfile
from jetflow_pl.generate_cli import main as generate_main

SMALL = data_gen.toy.SMALL_TARGET_DIR
HEAD = data_gen.toy.SMALL_HEAD_DIR
REAL = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"
PROMPT = "Ann has 4 bags with 6 apples each. How many apples?"
pytestmark = pytest.mark.skipif(
    not (SMALL / "model.safetensors").is_file(), reason=f"no toy target at {SMALL}"
)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Every test gets its own cost-profile cache (never the user's ~/.cache)."""
    monkeypatch.setenv("JETFLOW_PL_CACHE_DIR", str(tmp_path / "cache"))


def error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("error:")]


def test_auto_is_the_default_and_reports_budgets_and_predicted_speedup(tmp_path, capsys):
    report = tmp_path / "out.json"
    argv = ["--target", str(SMALL), "--head", str(HEAD), "--prompt", PROMPT, "--max-new-tokens", "24"]
    assert generate_main([*argv, "--compare", "--json", str(report)]) == 0
    out = capsys.readouterr()
    assert "budget auto:" in out.out and "predicted x" in out.out and "vs AR" in out.out
    assert "cost profile" in out.err and "measured now, quick, one pass" in out.err
    (row,) = json.loads(report.read_text())
    assert row["budget"] == "auto" and row["matches_hf_greedy"] is True
    assert sum(row["budgets_played"].values()) >= 1 and row["predicted_speedup_vs_ar"] > 0
    cached = list((tmp_path / "cache" / "cost_profiles").glob("*.json"))
    assert len(cached) == 1
    # a second run reuses the cached profile instead of measuring again
    assert generate_main([*argv, "--json", str(report)]) == 0
    err = capsys.readouterr().err
    assert f"cost profile {cached[0]}" in err and "measured now" not in err
    assert json.loads(report.read_text())[0]["output"] == row["output"]
    # the first run measured a quick one-pass profile; --measure-costs replaces it by the full one
    quick = CostProfile.load(cached[0])
    assert quick.quick and max(n for row in quick.nodes for n in row) <= QUICK_MAX_NODES
    assert generate_main([*argv, "--measure-costs", "--json", str(report)]) == 0
    assert "re-measured in full" in capsys.readouterr().err and not CostProfile.load(cached[0]).quick
    assert json.loads(report.read_text())[0]["output"] == row["output"]


def test_cost_profile_of_another_model_is_refused_in_one_line(tmp_path, capsys):
    alien = CostProfile(
        fingerprint={"cpu": "Other CPU", "target": "0123", "head": "4567"},
        batch_sizes=[1],
        nodes=[[1, 2]],
        round_s=[[0.01, 0.017]],
        kv_len=256,
        repeats=3,
    )
    path = alien.save(tmp_path / "alien.json")
    argv = ["--target", str(SMALL), "--head", str(HEAD), "--prompt", PROMPT, "--max-new-tokens", "4"]
    assert generate_main([*argv, "--cost-profile", str(path)]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "alien.json was measured for another model or machine" in line and "cpu: 'Other CPU'" in line


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory) -> Path:
    """A cost profile of the CLI's own backend (same fingerprint), measured on a short ladder: the tests
    below are about acceptance profiles, not about measuring costs."""
    from jetflow_pl.checkpoints import load_draft_head
    from jetflow_pl.decoding.budget.measure_costs import measure_cost_profile
    from jetflow_pl.runtime.torch_backend import TorchBackend
    from jetflow_pl.target import TargetModel

    target = TargetModel.from_pretrained(SMALL)
    prof = measure_cost_profile(
        TorchBackend(target, load_draft_head(HEAD)), kv_len=64, nodes=(1, 5, 17), repeats=1
    )
    return prof.save(tmp_path_factory.mktemp("profile") / "quick.json")


def test_acceptance_profiles_saved_and_width_checked(tmp_path, capsys, quick_profile):
    saved = tmp_path / "acc.json"
    argv = ["--target", str(SMALL), "--head", str(HEAD), "--prompt", PROMPT, "--max-new-tokens", "24"]
    argv += ["--cost-profile", str(quick_profile)]
    assert generate_main([*argv, "--budget", "16", "--save-acceptance-profile", str(saved)]) == 0
    prof = AcceptanceProfile.load(saved)
    assert prof.width == 4 and prof.budgets[0] == 0 and max(prof.budgets) == 16
    assert all(
        a <= b for a, b in zip(prof.tau, prof.tau[1:], strict=False)
    )  # a bigger tree never accepts less
    capsys.readouterr()
    assert generate_main([*argv, "--acceptance-profile", str(saved), "--width", "2"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "was measured at --width 4, not 2" in line
    assert generate_main([*argv, "--acceptance-profile", str(saved)]) == 0
    assert f"acceptance prior {saved}" in capsys.readouterr().err


def test_budget_flag_parsing(capsys):
    with pytest.raises(SystemExit) as info:
        generate_main(["--target", "t", "--prompt", "x", "--budget", "fast"])
    assert info.value.code == 2
    assert "argument --budget: expected an integer, got 'fast' (or 'auto')" in capsys.readouterr().err


def test_threads_flag_reaches_the_onnx_runtime_pool(monkeypatch, capsys):
    """`--threads N` sizes ONNX Runtime's intra-op pool as well as torch's: ORT keeps its own pool, and
    on a 2-core machine its default (2 threads) made SmolLM2 tree rounds 1.3x dearer than 1 thread."""
    import argparse

    from jetflow_pl import decode_options, generate_cli

    seen: dict = {}

    class Stop(Exception):
        pass

    def fake_load_backend(kind, **kwargs):
        seen.update(kind=kind, **kwargs)
        raise Stop

    monkeypatch.setattr(decode_options, "load_backend", fake_load_backend)
    args = generate_cli.build_parser().parse_args(
        ["--target", "t", "--prompt", "x", "--backend", "onnxruntime", "--engine-dir", "e", "--threads", "1"]
    )
    with pytest.raises(Stop):
        decode_options.load_backends(args, None, None)
    assert seen["kind"] == "onnxruntime" and seen["intra_op_threads"] == 1
    seen.clear()
    with pytest.raises(Stop):  # no flag: ORT's own default pool, as before
        decode_options.load_backends(argparse.Namespace(**{**vars(args), "threads": None}), None, None)
    assert seen["intra_op_threads"] is None
    with pytest.raises(SystemExit):
        generate_main(["--target", "t", "--prompt", "x", "--threads", "0"])
    assert "--threads" in capsys.readouterr().err


@pytest.fixture()
def templateless_target(tmp_path) -> Path:
    """The small target with its tokenizer stripped of the chat template (weights linked, not copied)."""
    out = tmp_path / "target"
    out.mkdir()
    for f in SMALL.iterdir():
        if f.name == "chat_template.jinja":
            continue
        if f.name == "tokenizer_config.json":
            cfg = json.loads(f.read_text())
            cfg.pop("chat_template", None)
            (out / f.name).write_text(json.dumps(cfg))
        else:
            (out / f.name).symlink_to(f.resolve())
    return out


def test_a_tokenizer_without_chat_template_is_one_line_until_raw_is_asked(templateless_target, capsys):
    argv = ["--target", str(templateless_target), "--head", str(HEAD), "--prompt", PROMPT, "--budget", "4"]
    assert generate_main([*argv, "--max-new-tokens", "4"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "has no chat template" in line and "--no-chat-template" in line
    assert generate_main([*argv, "--max-new-tokens", "4", "--no-chat-template"]) == 0


@pytest.mark.skipif(
    not (REAL / "model.safetensors").is_file(), reason=f"real target not materialized at {REAL}"
)
def test_untrained_head_needs_a_mask_token_from_the_tokenizer(capsys):
    """SmolLM2's tokenizer has no mask token: without --head there is no mask id to draft with."""
    assert generate_main(["--target", str(REAL), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "defines no mask token" in line and "--head" in line
