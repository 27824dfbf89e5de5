"""The one decode loop: draft a tree, verify it in one target pass, accept, commit, repeat.

`SpeculativeGenerator._round` is one round for a batch of requests (one of them, or many): ONE head
forward drafts for every request that drafts this round, each request builds its own tree (its own
budget), ONE target forward verifies every tree (own KV length, own mask), and each request accepts with
its own sampling settings and random generator, then stops on its own stop ids. `generate` is that round
for a batch of one, driven by `engine.DecodeEngine` (which schedules many requests: continuous batching).
With `budget=0` the tree is the root alone, which is exactly autoregressive decoding on the same backend
and cache code: `ARGenerator` is that baseline. The budget of each round comes from a `BudgetPolicy`
(`budget.py`): a fixed number, or `"auto"`, which picks per round from this machine's cost profile (at
the batch size being served) and the head's acceptance so far and drops to budget 0 (no draft forward)
where drafting cannot pay. Whatever the budget, every committed token is the target's own choice, so the
output is the same in every mode (lossless).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from jetflow_pl.decoding.budget import (
    LADDER_BUDGETS,
    AcceptanceStats,
    BudgetPolicy,
    FixedBudget,
    choose_round_budget,
    observe_round,
    resolve_budget,
)
from jetflow_pl.decoding.sampling import SamplingConfig, processed_probs
from jetflow_pl.errors import UserInputError, check_finite
from jetflow_pl.runtime.backend import DecodeBackend, max_budget, vocab_size
from jetflow_pl.tree import (
    SCORE_QUANTUM,
    DraftTree,
    FanoutPolicy,
    accept_greedy,
    accept_sampling,
    build_tree,
    rescore_and_select,
)

if TYPE_CHECKING:
    from jetflow_pl.decoding.engine import DecodeEngine

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


class SpeculativeGenerator:
    """Lossless tree speculative decoding for one sequence at a time.

    budget: draft tokens per tree (root excluded); 0 means plain autoregressive decoding. `"auto"` (an
        `AutoBudget` with this machine's cached cost profile) or any `BudgetPolicy` chooses it per round.
    width: children per expanded node (1 = a chain); `policy` may cap it per depth.
    refine_factor: 0 = off (default). k >= 2 = branch-conditioned refinement: build a candidate tree of
        `k * budget` draft tokens, re-score every node on its own path with one more head forward under
        the tree-causal mask (`backend.refine`), and verify the best `budget` of them (fixed budgets only).

    `acceptance` accumulates, over every generation, the accept length each round would have had at
    each ladder budget up to the one played (`AcceptanceStats`): the data of an acceptance profile.
    """

    def __init__(
        self,
        backend: DecodeBackend,
        budget: int | str | BudgetPolicy = 64,
        width: int = 4,
        policy: FanoutPolicy | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        refine_factor: int = 0,
    ) -> None:
        if refine_factor != 0 and refine_factor < 2:
            raise ValueError(f"refine_factor must be 0 (off) or >= 2, got {refine_factor}")
        budget_policy = resolve_budget(budget)
        if refine_factor and not isinstance(budget_policy, FixedBudget):
            raise UserInputError(
                "refine_factor needs a fixed budget: a refined tree is a selection, not a prefix of a larger "
                "tree, which is what budget='auto' learns from"
            )
        top = budget_policy.max_budget
        limit = max_budget(backend)
        if top is not None and max(top, refine_factor * top) > limit:
            what = f"budget {top}" + (f" x refine_factor {refine_factor}" if refine_factor else "")
            raise UserInputError(
                f"{what} exceeds this backend's limit of {limit} draft tokens per tree "
                f"({type(backend).__name__}); use a budget <= {limit // max(refine_factor, 1)}"
            )
        if width < 1:
            raise UserInputError(f"width must be >= 1, got {width}")
        if top is not None and top > 0 and backend.block_size < 2:
            raise UserInputError("a draft budget needs a backend with a draft head (block_size >= 2)")
        self.backend = backend
        self.max_budget = limit
        self.budget = budget_policy.budget if isinstance(budget_policy, FixedBudget) else budget
        self.budget_policy = budget_policy
        self.acceptance = AcceptanceStats([k for k in LADDER_BUDGETS if k <= limit])
        self.width = width
        self.policy = policy
        self.refine_factor = refine_factor
        self.score_quantum = SCORE_QUANTUM
        if eos_token_id is None:
            self.eos_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_ids = frozenset({eos_token_id})
        else:
            self.eos_ids = frozenset(int(t) for t in eos_token_id)

    def _tree(
        self, batch: Any, depth_logprobs: torch.Tensor, anchor: int, budget: int, past: int
    ) -> DraftTree:
        # NaN here means the head overflowed (fp16 is the usual cause); build_tree would refuse it too,
        # but only this loop knows it was the head and where, so the message can say what to change
        check_finite(
            depth_logprobs,
            "the draft head",
            f"log-probs at position {past}",
            "a float16/bfloat16 overflow in the head is the usual cause; run the head in float32 "
            "(or bfloat16 instead of float16) or check the head's weights",
        )
        if not self.refine_factor:
            return build_tree(depth_logprobs, anchor, budget, self.width, self.policy, self.score_quantum)
        candidates = build_tree(
            depth_logprobs,
            anchor,
            self.refine_factor * budget,
            self.width,
            self.policy,
            self.score_quantum,
        )
        return rescore_and_select(candidates, batch.refine(candidates), budget)

    @torch.no_grad()
    def _round(self, batch: Any, requests: Sequence[Any]) -> None:
        """One round for every request of the decoding batch (see the module docstring).

        `batch` speaks the batch protocol (`runtime.backend.BatchDecodeBackend`, or the one-slot adapter
        `engine.SingleSequence`); `requests` are the engine's live requests (slot, anchor token, sampling
        settings and generator, stop ids, budget override, result). Appends the round's tokens to each
        request's result and sets `finish_reason` where one finished.
        """
        slots = [r.slot for r in requests]
        # what each request may still produce: a tree yields a request at most that many tokens
        left = [r.max_new_tokens - len(r.handle.result.tokens) for r in requests]
        # the anchor sits at `past_len`; a depth-d node at `past_len + d` must stay inside the context.
        # The round's verify runs at the longest of them (a batch is padded to it), which prices its trees
        past = [batch.past_length(s) for s in slots]
        shared = choose_round_budget(self.budget_policy, [r.stats for r in requests], left, max(past))
        budgets = [shared if r.budget is None else r.budget for r in requests]
        started = time.perf_counter()
        depth = [batch.max_positions - 1 - p for p in past]
        drafting = [k > 0 and d >= 1 for k, d in zip(budgets, depth, strict=True)]
        lps = None
        if any(drafting):
            # the deepest any tree of this round can grow (a budget-k tree is at most k deep; refinement
            # builds its candidates at refine_factor x k): a causal head drafts only that far
            grow = max(self.refine_factor, 1)
            need = max(min(grow * k, d) for k, d, on in zip(budgets, depth, drafting, strict=True) if on)
            lps = batch.draft_batch(slots, [r.token for r in requests], need)
        trees = [
            self._tree(batch, lps[i][: depth[i]], r.token, budgets[i], past[i])
            if drafting[i]
            else DraftTree.chain([r.token])
            for i, r in enumerate(requests)
        ]
        logits = batch.verify_batch(slots, trees)
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
        batch.commit_batch(slots, accepted_all)
        observe_round(self.budget_policy, trees, accepted_all, time.perf_counter() - started)
        for r, tree, accepted, token, budget in zip(
            requests, trees, accepted_all, nexts, budgets, strict=True
        ):
            if not self.refine_factor:  # a refined tree is not a prefix tree (see budget.py)
                self.acceptance.observe(accepted, tree.budget)
                r.stats.observe(accepted, tree.budget)
            res = r.handle.result
            res.accept_lengths.append(len(accepted))
            res.budgets.append(budget)
            r.token = token
            for new in [*tree.tokens[accepted[1:]].tolist(), token]:
                res.tokens.append(int(new))
                if new in r.stop_ids:
                    res.finish_reason = "eos" if new in self.eos_ids else "stop"
                    break
                if len(res.tokens) >= r.max_new_tokens:
                    res.finish_reason = "length"
                    break

    def check_prompt(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """The prompt as a `[T]` long tensor, or one `UserInputError` saying what is wrong with the request."""
        if max_new_tokens < 0:
            raise UserInputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
        if prompt.dim() > 1 and prompt.shape[0] != 1:
            # flattening [2, T] would silently decode two prompts glued together
            raise UserInputError(
                f"prompt_ids must be one sequence ([T] or [1, T]), got shape {list(prompt.shape)}; "
                "submit several prompts to an engine (SpeculativeGenerator.engine) to decode them together"
            )
        prompt = prompt.reshape(-1)
        if prompt.numel() == 0:
            raise UserInputError("prompt is empty: at least one token is needed to start decoding")
        vocab = vocab_size(self.backend)
        lo, hi = int(prompt.min()), int(prompt.max())
        if lo < 0 or (vocab is not None and hi >= vocab):
            # caught here because an out-of-range id in the embedding lookup is a device-side assert on
            # CUDA, which poisons the whole process instead of raising
            bad = lo if lo < 0 else hi
            bound = f"[0, {vocab - 1}]" if vocab is not None else ">= 0"
            raise UserInputError(f"prompt token id {bad} is outside the target's vocabulary {bound}")
        limit = self.backend.max_positions
        if prompt.numel() + max_new_tokens > limit:
            raise UserInputError(
                f"prompt ({prompt.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"target's context limit of {limit} positions"
            )
        return prompt

    def engine(self, **kwargs: Any) -> DecodeEngine:
        """A `DecodeEngine` (continuous batching) over this generator's backend and algorithm; keyword
        arguments as `DecodeEngine` (`max_batch`, `prefill_chunk`, `max_kv_tokens`, `max_queue`)."""
        from jetflow_pl.decoding.engine import DecodeEngine

        return DecodeEngine(self, **kwargs)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
    ) -> GenerationResult:
        """Generate up to `max_new_tokens` tokens after `prompt_ids` (stops after an EOS token): the
        engine's round for a batch of one, over the backend's one-sequence protocol."""
        from jetflow_pl.decoding.engine import DecodeEngine, SingleSequence

        prompt = self.check_prompt(prompt_ids, max_new_tokens)
        if max_new_tokens == 0:
            return GenerationResult(tokens=[])
        engine = DecodeEngine(self, max_batch=1, prefill_chunk=None, backend=SingleSequence(self.backend))
        engine.start()  # may measure this machine's cost profile once (budget="auto"): before the clock starts
        handle = engine.submit(prompt, max_new_tokens, sampling or SamplingConfig())
        engine.run()
        return handle.result


class ARGenerator(SpeculativeGenerator):
    """Autoregressive baseline: the same loop, backend and cache code with an empty draft budget."""

    def __init__(self, backend: DecodeBackend, eos_token_id: int | Sequence[int] | None = None) -> None:
        super().__init__(backend, budget=0, width=1, eos_token_id=eos_token_id)
