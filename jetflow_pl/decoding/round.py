"""One decode round for a batch of requests: draft, build each tree, verify, accept, commit.

`run_round` is the only place a round happens. A batch of one and a batch of many run the same code:
ONE head forward drafts for every request that drafts this round, each request builds its own tree (its
own budget), ONE target forward verifies every tree (own KV length, own mask), and each request accepts
with its own sampling settings and random generator, then stops on its own stop ids. The round asks the
budget policy for the shared budget (`RoundInfo`) and tells it, and every round observer, what happened
(`RoundResult`). With budget 0 the tree is the root alone: exactly autoregressive decoding on the same
backend and cache code. Whatever the budget, every committed token is the target's own choice.

`engine.DecodeEngine` schedules requests and calls this once per step; `generator.SpeculativeGenerator`
holds the algorithm's settings (`RoundSettings`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from jetflow_pl.decoding.budget.acceptance import AcceptanceStats
from jetflow_pl.decoding.budget.policy import BudgetPolicy, RoundInfo, RoundObserver, RoundResult
from jetflow_pl.decoding.sampling import SamplingConfig, processed_probs
from jetflow_pl.errors import check_finite
from jetflow_pl.runtime.backend import DecodeBackend
from jetflow_pl.tree import (
    DraftTree,
    FanoutPolicy,
    accept_greedy,
    accept_sampling,
    build_tree,
    rescore_and_select,
)

__all__ = ["GenerationResult", "RoundRequest", "RoundSettings", "run_round"]

_TARGET_ADVICE = "a float16 overflow in the target is the usual cause; load it in bfloat16 or float32"


@dataclass
class GenerationResult:
    """Tokens and the metrics of docs/DESIGN.md section 4 for one sequence.

    accept_lengths: tokens committed per target verify forward (accepted drafts + 1), one per round.
    decode_seconds excludes the prefill; the first new token comes from the prefill logits.
    """

    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)
    #: the draft budget each round was played at (same length as accept_lengths)
    budgets: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = "length"
    #: `time.perf_counter()` when the request was submitted, drew its first token, finished (0: unset)
    submitted_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0

    @property
    def num_rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify forward (0 when no round ran)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by the decode rounds per second (prefill and its token excluded)."""
        n = max(len(self.tokens) - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def latency_s(self) -> float:
        """Seconds from submission to the last token (queueing and prefill included)."""
        return self.finished_at - self.submitted_at if self.finished_at else 0.0

    @property
    def ttft_s(self) -> float:
        """Seconds from submission to the first token."""
        return self.first_token_at - self.submitted_at if self.first_token_at else 0.0


class RoundSettings(Protocol):
    """The algorithm a round runs (`SpeculativeGenerator` is one): budget policy, tree shape, stop ids and
    the round observers (a session's acceptance statistics are one: `AcceptanceStats.observe_round`)."""

    backend: DecodeBackend
    budget_policy: BudgetPolicy
    width: int
    policy: FanoutPolicy | None
    refine_factor: int
    score_quantum: float
    eos_ids: frozenset[int]
    observers: list[RoundObserver]
    max_budget: int


class RoundRequest(Protocol):
    """What a round reads and updates of a request in flight (the engine's live request)."""

    slot: int
    token: int  # the anchor: the last committed token, not yet in the KV cache
    max_new_tokens: int
    sampling: SamplingConfig
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    budget: int | None  # a fixed budget for this request (None: the policy's)
    stats: AcceptanceStats
    result: GenerationResult


def draft_tree(
    settings: RoundSettings,
    backend: DecodeBackend,
    depth_logprobs: torch.Tensor,
    anchor: int,
    budget: int,
    past: int,
) -> DraftTree:
    """The request's tree from its draft log-probs (refined by one more head forward when
    `refine_factor` is set)."""
    # NaN here means the head overflowed (fp16 is the usual cause); build_tree would refuse it too,
    # but only this loop knows it was the head and where, so the message can say what to change
    check_finite(
        depth_logprobs,
        "the draft head",
        f"log-probs at position {past}",
        "a float16/bfloat16 overflow in the head is the usual cause; run the head in float32 "
        "(or bfloat16 instead of float16) or check the head's weights",
    )
    s = settings
    if not s.refine_factor:
        return build_tree(depth_logprobs, anchor, budget, s.width, s.policy, s.score_quantum)
    candidates = build_tree(
        depth_logprobs, anchor, s.refine_factor * budget, s.width, s.policy, s.score_quantum
    )
    return rescore_and_select(candidates, backend.refine(candidates), budget)


@torch.no_grad()
def run_round(settings: RoundSettings, backend: DecodeBackend, requests: Sequence[RoundRequest]) -> None:
    """One round for every request of the decoding batch (see the module docstring). Appends the round's
    tokens to each request's result and sets `finish_reason` where one finished."""
    s = settings
    slots = [r.slot for r in requests]
    # what each request may still produce: a tree yields a request at most that many tokens
    left = [r.max_new_tokens - len(r.result.tokens) for r in requests]
    # the anchor sits at `past_len`; a depth-d node at `past_len + d` must stay inside the context
    past = [backend.past_length(slot) for slot in slots]
    shared = s.budget_policy.choose(RoundInfo([r.stats for r in requests], left))
    budgets = [int(shared) if r.budget is None else r.budget for r in requests]
    started = time.perf_counter()
    depth = [backend.max_positions - 1 - p for p in past]
    drafting = [k > 0 and d >= 1 for k, d in zip(budgets, depth, strict=True)]
    lps = None
    if any(drafting):
        # the deepest any tree of this round can grow (a budget-k tree is at most k deep; refinement
        # builds its candidates at refine_factor x k): a causal head drafts only that far
        grow = max(s.refine_factor, 1)
        need = max(min(grow * k, d) for k, d, on in zip(budgets, depth, drafting, strict=True) if on)
        lps = backend.draft_batch(slots, [r.token for r in requests], need)
    trees = [
        draft_tree(s, backend, lps[i][: depth[i]], r.token, budgets[i], past[i])
        if drafting[i]
        else DraftTree.chain([r.token])
        for i, r in enumerate(requests)
    ]
    logits = backend.verify_batch(slots, trees)
    accepted_all, nexts = [], []
    for r, tree, lg, p in zip(requests, trees, logits, past, strict=True):
        # argmax over NaN picks garbage silently: a lossless decoder must refuse instead
        check_finite(lg, "the target", f"logits at position {p}", _TARGET_ADVICE)
        if r.sampling.greedy:
            accepted, token = accept_greedy(tree, lg.argmax(dim=-1))
        else:
            accepted, token = accept_sampling(tree, processed_probs(lg, r.sampling), r.generator)
        accepted_all.append(accepted)
        nexts.append(token)
    backend.commit_batch(slots, accepted_all)
    outcome = RoundResult(trees, accepted_all, budgets, time.perf_counter() - started)
    s.budget_policy.observe(outcome)
    for observer in s.observers:
        observer(outcome)
    for r, tree, accepted, token, budget in zip(requests, trees, accepted_all, nexts, budgets, strict=True):
        if not s.refine_factor:  # a refined tree is not a prefix tree (budget/acceptance.py)
            r.stats.observe(accepted, tree.budget)
        res = r.result
        res.accept_lengths.append(len(accepted))
        res.budgets.append(budget)
        r.token = token
        for new in [*tree.tokens[accepted[1:]].tolist(), token]:
            res.tokens.append(int(new))
            if new in r.stop_ids:
                res.finish_reason = "eos" if new in s.eos_ids else "stop"
                break
            if len(res.tokens) >= r.max_new_tokens:
                res.finish_reason = "length"
                break
