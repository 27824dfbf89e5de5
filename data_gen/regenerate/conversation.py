"""Answering a batch of conversations turn by turn: the loop both regeneration modules share.

A batch (`prompts.collate_left`) holds each sample's first-turn prompt ids and its later user turns. Turn
by turn, every conversation still open is sent to `generate` at once (one batched call in process, one
request per conversation at a time through an endpoint); each answer is appended to its conversation
exactly as generated, and the next user turn is appended with `jetflow_pl.chat.continue_chat`, so turn k
sees the target's own answers to turns 1..k-1. A conversation ends after its last turn, or before a turn
whose prompt plus `max_new_tokens` would not fit the batch's `context_limit` (`cut_by_context`).

The finished row: `input_ids` = the whole conversation, `loss_mask` = 1 exactly on the answers' ids (each
stop token included), 0 on the prompt and on the template text between turns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jetflow_pl.chat import continue_chat

#: `generate(rows, prompts)`: per row either `(response ids, finish reason)` or the exception it raised
GenerateFn = Callable[[list[int], list[list[int]]], list[tuple[list[int], str] | BaseException]]


@dataclass
class Transcript:
    """One conversation as it grows: all ids so far, the loss mask over them, each turn's answer."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    cut_by_context: bool = False

    def __post_init__(self) -> None:
        if not self.ids:
            self.ids = list(self.prompt_ids)
            self.loss_mask = [0] * len(self.prompt_ids)

    @property
    def response_ids(self) -> list[int]:
        """Everything after the first prompt: the answers and the turns between them."""
        return self.ids[len(self.prompt_ids) :]


def answer_turns(
    batch: dict,
    rows: Sequence[int],
    generate: GenerateFn,
    tokenizer: Any,
    stop_ids: Sequence[int],
    max_new_tokens: int,
) -> tuple[dict[int, Transcript], dict[int, BaseException]]:
    """Answer every turn of the conversations at batch `rows`; returns the finished transcripts and, per
    row that failed, the exception (a failed conversation is dropped whole: it is retried by a rerun)."""
    limit = batch.get("context_limit")
    later_turns = batch.get("later_turns") or [[] for _ in batch["ids"]]
    systems = batch.get("systems") or [None for _ in batch["ids"]]
    out = {r: Transcript(prompt_ids=[int(t) for t in batch["prompt_ids"][r]]) for r in rows}
    failed: dict[int, BaseException] = {}
    active, turn = list(rows), 0
    while active:
        results = generate(active, [out[r].ids for r in active])
        still_open = []
        for r, res in zip(active, results, strict=True):
            if isinstance(res, BaseException):
                failed[r] = res
                continue
            tokens, reason = res
            t = out[r]
            t.answers.append(list(tokens))
            t.reasons.append(reason)
            if turn >= len(later_turns[r]):
                t.ids += tokens
                t.loss_mask += [1] * len(tokens)
                continue
            nxt = continue_chat(tokenizer, t.ids, tokens, later_turns[r][turn], stop_ids, systems[r])
            t.ids += tokens
            t.loss_mask += [1] * len(tokens)
            if limit is not None and len(nxt) + max_new_tokens > limit:
                t.cut_by_context = True
                continue
            t.loss_mask += [0] * (len(nxt) - len(t.ids))
            t.ids = nxt
            still_open.append(r)
        active, turn = still_open, turn + 1
    return {r: t for r, t in out.items() if r not in failed}, failed


def transcript_records(tokenizer: Any, batch: dict, transcripts: dict[int, Transcript]) -> list[dict]:
    """The records `predict_step` returns (what `RegenerationWriter` turns into rows), in batch order."""
    records = []
    for r in sorted(transcripts):
        t = transcripts[r]
        records.append(
            {
                "id": batch["ids"][r],
                "domain": batch["domains"][r],
                "prompt_ids": t.prompt_ids,
                "response_ids": t.response_ids,
                "loss_mask": t.loss_mask,
                # the answers' text (special tokens dropped), turns separated by a blank line
                "text": "\n\n".join(tokenizer.decode(a, skip_special_tokens=True) for a in t.answers),
                "finish_reason": t.reasons[-1],
                "truncated": bool(batch["truncated"][r]),
                "turns": len(t.answers),
                "cut_by_context": t.cut_by_context,
            }
        )
    return records
