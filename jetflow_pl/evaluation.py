"""The paper-style evaluation of a head on prompt sets: per category and budget, tau, per-position acceptance,
decode speed against the backend's own AR in the same run, and a lossless check (`python -m jetflow_pl
evaluate`, `jetflow_pl/evaluate_cli.py`).

Contract:
- Every conversation is answered turn by turn. Turn 1 is its first user turn; turn `t + 1` is the next user
  turn after the target's own (greedy AR) answer to turn `t`, joined by `chat.continue_chat`, the one way
  the library continues a conversation (as MT-Bench's second turns are meant to be asked).
- For each turn and repeat, AR and every speculative configuration decode the same prompt ids greedily, in
  an order rotated per turn and repeat (`rotated`), so no configuration always runs first on a drifting
  machine. Each output must equal AR's tokens (`mismatches` counts those that do not).
- Aggregates are pooled per group (a source's categories, all of it, each turn): tau = committed tokens per
  verify forward; `accept_rate_per_position[i]` = share of drafting rounds (budget > 0) whose accepted
  path reached depth `i + 1` (vLLM's per-position acceptance rate); the speedup over AR is the ratio of
  decode tokens/s pooled over the group's turns, one per repeat, reported as median / min / max.

Nothing here stores prompt or answer text (ShareGPT's carries no license): items are named by their ids.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jetflow_pl.chat import continue_chat, row_conversation
from jetflow_pl.decoding import GenerationResult, SamplingConfig
from jetflow_pl.errors import UserInputError

#: positions reported by `accept_rate_per_position` at most (deeper paths are rare and noisy)
MAX_POSITIONS = 16
AR_LABEL = "ar"


@dataclass
class Conversation:
    """One evaluation conversation: its source's short name, category, id, first-turn chat and later user
    turns (already capped at the requested number of turns)."""

    source: str
    category: str
    conv_id: str
    first: list[dict]
    later: list[str]
    system: str | None = None


@dataclass
class DecodeConfig:
    """A labelled way to decode: `generate(ids, max_new_tokens, sampling) -> GenerationResult`."""

    label: str
    generate: Callable[..., GenerationResult]
    budget: int | str = 0
    head: str | None = None
    #: the generator behind `generate` where there is one
    generator: Any = None
    #: the acceptance it records once measuring starts (`SpeculativeGenerator.record_acceptance`)
    acceptance: Any = None
    #: the ids the head can draft (its draft vocabulary); None = every id
    draft_vocab: frozenset[int] | None = None


@dataclass
class Run:
    """One decode of one turn by one configuration, as recorded (no text)."""

    config: str
    repeat: int
    new_tokens: int
    decode_seconds: float
    accept_lengths: list[int]
    budgets: list[int]
    matches_ar: bool
    #: AR's tokens of this turn the head cannot draft (outside its draft vocabulary)
    outside_draft_vocab: int = 0


@dataclass
class TurnRecord:
    source: str
    category: str
    conv_id: str
    turn: int
    prompt_tokens: int
    runs: list[Run] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "category": self.category,
            "id": self.conv_id,
            "turn": self.turn,
            "prompt_tokens": self.prompt_tokens,
            "runs": [
                {
                    "config": r.config,
                    "repeat": r.repeat,
                    "new_tokens": r.new_tokens,
                    "decode_seconds": round(r.decode_seconds, 6),
                    "rounds": len(r.accept_lengths),
                    "tau": round(sum(r.accept_lengths) / len(r.accept_lengths), 4)
                    if r.accept_lengths
                    else 0.0,
                    "budgets_played": dict(Counter(r.budgets)),
                    "matches_ar": r.matches_ar,
                    "outside_draft_vocab": r.outside_draft_vocab,
                }
                for r in self.runs
            ],
        }


def conversations_from_rows(
    rows: Sequence[dict],
    source: str,
    max_turns: int,
    max_per_category: int | None = None,
    skip_per_category: int = 0,
) -> list[Conversation]:
    """Rows of a prompt source (`prompt_sets.load_prompt_rows`) as conversations of at most `max_turns`
    user turns: per category, in the source's order, the first `skip_per_category` rows are passed over
    (e.g. prompts a head was selected on) and at most `max_per_category` taken. A row without a `domain`
    falls in the category named after the source."""
    taken: Counter = Counter()
    seen: Counter = Counter()
    out = []
    for i, row in enumerate(rows):
        category = str(row.get("domain") or source)
        seen[category] += 1
        if seen[category] <= skip_per_category:
            continue
        if max_per_category is not None and taken[category] >= max_per_category:
            continue
        first, later, system = row_conversation(row, f"{source} row {i}", max_turns=max_turns)
        conv_id = str(row.get("id", f"{source}-{i}"))
        out.append(Conversation(source, category, conv_id, first, later, system))
        taken[category] += 1
    return out


def rotated(items: Sequence[Any], start: int) -> list[Any]:
    """`items` starting at index `start % len(items)` and going round."""
    k = start % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


def evaluate_conversations(
    conversations: Sequence[Conversation],
    ar: DecodeConfig,
    configs: Sequence[DecodeConfig],
    tokenizer: Any,
    stop_ids: Iterable[int],
    max_new_tokens: int,
    repeats: int = 1,
    max_context: int | None = None,
    on_turn: Callable[[TurnRecord], None] | None = None,
    chat: bool = True,
) -> tuple[list[TurnRecord], Counter]:
    """Decode every turn of every conversation with `ar` and each of `configs` (module docstring).

    `chat=False` (a base model): each conversation's first user turn is tokenized as plain text and
    continued; it has no later turns (a chat needs the template).

    Returns the turn records and the count of turns skipped, by reason (a turn whose prompt plus
    `max_new_tokens` exceeds `max_context` ends its conversation there). `on_turn` is called after each
    turn (progress).
    """
    from jetflow_pl.chat import chat_ids, encode_prompt

    stops = [int(s) for s in stop_ids]
    sampling = SamplingConfig()  # greedy: the lossless check compares tokens
    everyone = [ar, *configs]
    records: list[TurnRecord] = []
    skipped: Counter = Counter()
    turn_no = 0
    for conv in conversations:
        if not chat and conv.later:
            raise UserInputError(
                "plain-text prompts (no chat template) are answered one turn each: --turns 1"
            )
        ids = (
            chat_ids(tokenizer, conv.first)
            if chat
            else encode_prompt(tokenizer, conv.first[-1]["content"], chat=False)
        )
        answer: list[int] = []
        for t in range(1 + len(conv.later)):
            if t > 0:
                ids = continue_chat(tokenizer, ids, answer, conv.later[t - 1], stops, conv.system)
            if max_context is not None and len(ids) + max_new_tokens > max_context:
                skipped["over the context limit"] += len(conv.later) + 1 - t
                break
            rec = TurnRecord(conv.source, conv.category, conv.conv_id, t + 1, len(ids))
            reference: list[int] | None = None
            for r in range(repeats):
                results: dict[str, GenerationResult] = {}
                for cfg in rotated(everyone, turn_no + r):
                    results[cfg.label] = cfg.generate(ids, max_new_tokens, sampling)
                if reference is None:
                    reference = list(results[ar.label].tokens)
                for cfg in everyone:
                    res = results[cfg.label]
                    outside = 0
                    if cfg.draft_vocab is not None:
                        outside = sum(1 for tok in reference if tok not in cfg.draft_vocab)
                    rec.runs.append(
                        Run(
                            cfg.label,
                            r,
                            len(res.tokens),
                            res.decode_seconds,
                            list(res.accept_lengths),
                            list(res.budgets),
                            list(res.tokens) == reference,
                            outside,
                        )
                    )
            answer = reference or []
            records.append(rec)
            turn_no += 1
            if on_turn is not None:
                on_turn(rec)
    return records, skipped


def group_keys(records: Sequence[TurnRecord]) -> list[tuple[str, str]]:
    """(source, group) pairs in table order: each source's categories (where it has several), `all`, and
    `turn N` (where it has several turns)."""
    keys: list[tuple[str, str]] = []
    for source in dict.fromkeys(r.source for r in records):
        mine = [r for r in records if r.source == source]
        cats = list(dict.fromkeys(r.category for r in mine))
        turns = sorted({r.turn for r in mine})
        if len(cats) > 1:
            keys += [(source, c) for c in cats]
        keys.append((source, "all"))
        if len(turns) > 1:
            keys += [(source, f"turn {t}") for t in turns]
    return keys


def _in_group(rec: TurnRecord, source: str, group: str) -> bool:
    if rec.source != source:
        return False
    if group == "all":
        return True
    if group.startswith("turn "):
        return rec.turn == int(group.split()[1])
    return rec.category == group


def summarize(records: Sequence[TurnRecord], configs: Sequence[str], repeats: int) -> list[dict]:
    """One table row per (group, speculative configuration) (module docstring for the metrics)."""
    rows = []
    for source, group in group_keys(records):
        mine = [r for r in records if _in_group(r, source, group)]
        ar_runs = [run for r in mine for run in r.runs if run.config == AR_LABEL]
        for label in configs:
            runs = [run for r in mine for run in r.runs if run.config == label]
            rows.append(
                {"source": source, "group": group, "config": label, **_metrics(runs, ar_runs, repeats)}
            )
    return rows


def _tps(runs: Sequence[Run]) -> float:
    """Decode tokens/s pooled over runs (each run's first token comes from the prefill)."""
    seconds = sum(r.decode_seconds for r in runs)
    return sum(max(r.new_tokens - 1, 0) for r in runs) / seconds if seconds > 0 else 0.0


def _metrics(runs: Sequence[Run], ar_runs: Sequence[Run], repeats: int) -> dict:
    lengths = [a for r in runs for a in r.accept_lengths]
    drafted = [a for r in runs for a, b in zip(r.accept_lengths, r.budgets, strict=True) if b > 0]
    depth = min(MAX_POSITIONS, max((a - 1 for a in drafted), default=0))
    per_pos = [sum(1 for a in drafted if a - 1 >= i) / len(drafted) for i in range(1, depth + 1)]
    speedups, ar_tps, spec_tps = [], [], []
    for rep in range(repeats):
        spec = _tps([r for r in runs if r.repeat == rep])
        base = _tps([r for r in ar_runs if r.repeat == rep])
        spec_tps.append(spec)
        ar_tps.append(base)
        speedups.append(spec / base if base > 0 else 0.0)
    return {
        "turns": len([r for r in runs if r.repeat == 0]),
        "new_tokens": sum(r.new_tokens for r in runs if r.repeat == 0),
        "rounds": len(lengths),
        "tau": sum(lengths) / len(lengths) if lengths else 0.0,
        "drafting_rounds": len(drafted),
        "mean_accepted_drafts": sum(a - 1 for a in drafted) / len(drafted) if drafted else 0.0,
        "accept_rate_per_position": [round(p, 4) for p in per_pos],
        "budgets_played": dict(Counter(b for r in runs for b in r.budgets).most_common()),
        "decode_tokens_per_s": statistics.median(spec_tps) if spec_tps else 0.0,
        "ar_decode_tokens_per_s": statistics.median(ar_tps) if ar_tps else 0.0,
        "speedup_vs_ar": statistics.median(speedups) if speedups else 0.0,
        "speedup_vs_ar_min": min(speedups, default=0.0),
        "speedup_vs_ar_max": max(speedups, default=0.0),
        "speedup_vs_ar_per_repeat": [round(s, 4) for s in speedups],
        "mismatches": sum(1 for r in runs if not r.matches_ar),
        # share of AR's tokens the head could not have drafted (outside its draft vocabulary): a floor on
        # the rounds that must end there
        "outside_draft_vocab": sum(r.outside_draft_vocab for r in runs if r.repeat == 0)
        / max(1, sum(r.new_tokens for r in runs if r.repeat == 0)),
        "ar_repeat_mismatches": sum(1 for r in ar_runs if not r.matches_ar),
    }


def format_table(rows: Sequence[dict]) -> str:
    """The table as aligned text: one line per (group, configuration). `acc@i`: per-position acceptance;
    `oov%`: AR tokens outside the head's draft vocabulary."""
    head = (
        f"{'source':<10} {'group':<12} {'config':<28} {'turns':>5} {'tau':>5} {'acc@1':>6} {'acc@2':>6} "
        f"{'acc@3':>6} {'oov%':>5} {'tok/s':>7} {'AR tok/s':>8} {'x AR':>5} {'(min-max)':>11} {'lossless':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        acc = (r["accept_rate_per_position"] + [0.0, 0.0, 0.0])[:3]
        spread = f"{r['speedup_vs_ar_min']:.2f}-{r['speedup_vs_ar_max']:.2f}"
        lines.append(
            f"{r['source']:<10} {r['group']:<12} {r['config']:<28} {r['turns']:>5} {r['tau']:>5.2f} "
            f"{acc[0]:>6.2f} {acc[1]:>6.2f} {acc[2]:>6.2f} {100 * r['outside_draft_vocab']:>5.1f} "
            f"{r['decode_tokens_per_s']:>7.1f} "
            f"{r['ar_decode_tokens_per_s']:>8.1f} {r['speedup_vs_ar']:>5.2f} {spread:>11} "
            f"{'yes' if r['mismatches'] == 0 else 'NO (' + str(r['mismatches']) + ')':>8}"
        )
    return "\n".join(lines)


def format_markdown(rows: Sequence[dict]) -> str:
    """The table as Markdown (for a head card or a journal): speedups as median [min-max] over repeats."""
    lines = [
        "| source | group | config | turns | tau | acceptance @1 / @2 / @3 | outside draft vocab | tok/s | "
        "vs own AR | lossless |",
        "|---|---|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        acc = (r["accept_rate_per_position"] + [0.0, 0.0, 0.0])[:3]
        spread = (
            f" [{r['speedup_vs_ar_min']:.2f}-{r['speedup_vs_ar_max']:.2f}]"
            if len(r["speedup_vs_ar_per_repeat"]) > 1
            else ""
        )
        lines.append(
            f"| {r['source']} | {r['group']} | {r['config']} | {r['turns']} | {r['tau']:.2f} | "
            f"{acc[0]:.2f} / {acc[1]:.2f} / {acc[2]:.2f} | {100 * r['outside_draft_vocab']:.1f}% | "
            f"{r['decode_tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x{spread} | "
            f"{'yes' if r['mismatches'] == 0 else 'NO'} |"
        )
    return "\n".join(lines)


def plot_table(rows: Sequence[dict], path: Any) -> None:
    """Two panels: tau per group and configuration (bars), and per-position acceptance of each source's
    `all` group (lines). Written with matplotlib's Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    configs = list(dict.fromkeys(r["config"] for r in rows))
    groups = list(dict.fromkeys((r["source"], r["group"]) for r in rows))
    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(max(8.0, 0.6 * len(groups) * max(1, len(configs)) + 4), 4.5)
    )
    width = 0.8 / max(1, len(configs))
    for j, cfg in enumerate(configs):
        taus = [
            next((r["tau"] for r in rows if (r["source"], r["group"]) == g and r["config"] == cfg), 0.0)
            for g in groups
        ]
        ax1.bar([i + j * width for i in range(len(groups))], taus, width, label=cfg)
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax1.set_xticklabels(
        [f"{s}\n{g}" if g == "all" else g for s, g in groups], rotation=60, ha="right", fontsize=7
    )
    ax1.set_ylabel("tau (tokens per verify forward)")
    ax1.axhline(1.0, color="grey", lw=0.5)
    ax1.legend(fontsize=7)
    for r in rows:
        if r["group"] == "all" and r["accept_rate_per_position"]:
            pos = range(1, len(r["accept_rate_per_position"]) + 1)
            ax2.plot(
                pos, r["accept_rate_per_position"], marker="o", ms=3, label=f"{r['source']} {r['config']}"
            )
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance rate (share of drafting rounds)")
    ax2.set_ylim(0, 1)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
