"""`SpeculativeGenerator`: the decode algorithm's settings, and `generate` for one prompt.

The round itself is `round.run_round` (draft a tree, verify it in one target pass, accept, commit); the
scheduling of many requests is `engine.DecodeEngine`; `generate` is the engine with one request. With
`budget=0` the tree is the root alone, which is exactly autoregressive decoding on the same backend and
cache code: `ARGenerator` is that baseline. The budget of each round comes from a `BudgetPolicy`
(`budget/`): a fixed number, or `"auto"`, which picks per round from this machine's cost profile (at the
batch size being served) and the head's acceptance so far and drops to budget 0 (no draft forward) where
drafting cannot pay. Whatever the budget, every committed token is the target's own choice, so the output
is the same in every mode (lossless).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from jetflow_pl.decoding.budget import (
    LADDER_BUDGETS,
    AcceptanceStats,
    BudgetPolicy,
    FixedBudget,
    RoundObserver,
    resolve_budget,
)
from jetflow_pl.decoding.engine import DecodeEngine
from jetflow_pl.decoding.round import GenerationResult
from jetflow_pl.decoding.sampling import SamplingConfig
from jetflow_pl.errors import UserInputError
from jetflow_pl.runtime.backend import DecodeBackend, max_budget, vocab_size
from jetflow_pl.tree import SCORE_QUANTUM, FanoutPolicy

__all__ = ["ARGenerator", "GenerationResult", "SpeculativeGenerator"]


class SpeculativeGenerator:
    """Lossless tree speculative decoding for one sequence at a time.

    budget: draft tokens per tree (root excluded); 0 means plain autoregressive decoding. `"auto"` (an
        `AutoBudget` with this machine's cached cost profile) or any `BudgetPolicy` chooses it per round.
    width: children per expanded node (1 = a chain); `policy` may cap it per depth.
    refine_factor: 0 = off (default). k >= 2 = branch-conditioned refinement: build a candidate tree of
        `k * budget` draft tokens, re-score every node on its own path with one more head forward under
        the tree-causal mask (`backend.refine`), and verify the best `budget` of them (fixed budgets only).

    `observers` are called with every round's `RoundResult` (benchmarks record rounds this way).
    """

    def __init__(
        self,
        backend: DecodeBackend,
        budget: int | str | BudgetPolicy = 64,
        width: int = 4,
        policy: FanoutPolicy | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        refine_factor: int = 0,
        observers: Sequence[RoundObserver] = (),
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
        self.width = width
        self.policy = policy
        self.refine_factor = refine_factor
        self.score_quantum = SCORE_QUANTUM
        self.observers: list[RoundObserver] = list(observers)
        if eos_token_id is None:
            self.eos_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_ids = frozenset({eos_token_id})
        else:
            self.eos_ids = frozenset(int(t) for t in eos_token_id)

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

    def record_acceptance(self) -> AcceptanceStats:
        """Statistics that accumulate, from now on, the accept length each round would have had at each
        ladder budget up to the one played: the data of an acceptance profile (`to_profile`). A refined
        tree is a selection, not a prefix tree, so a generator with `refine_factor` records nothing."""
        stats = AcceptanceStats([k for k in LADDER_BUDGETS if k <= self.max_budget])
        if not self.refine_factor:
            self.observers.append(stats.observe_round)
        return stats

    def engine(self, **kwargs: Any) -> DecodeEngine:
        """A `DecodeEngine` (continuous batching) over this generator's backend and algorithm; keyword
        arguments as `DecodeEngine` (`max_batch`, `prefill_chunk`, `max_kv_tokens`, `max_queue`)."""
        return DecodeEngine(self, **kwargs)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
    ) -> GenerationResult:
        """Generate up to `max_new_tokens` tokens after `prompt_ids` (stops after an EOS token): the
        engine's round for a batch of one (slot 0 of the backend)."""
        prompt = self.check_prompt(prompt_ids, max_new_tokens)
        if max_new_tokens == 0:
            return GenerationResult(tokens=[])
        engine = DecodeEngine(self, max_batch=1, prefill_chunk=None)
        engine.start()  # may measure this machine's cost profile once (budget="auto"): before the clock starts
        handle = engine.submit(prompt, max_new_tokens, sampling or SamplingConfig())
        engine.run()
        return handle.result


class ARGenerator(SpeculativeGenerator):
    """Autoregressive baseline: the same loop, backend and cache code with an empty draft budget."""

    def __init__(self, backend: DecodeBackend, eos_token_id: int | Sequence[int] | None = None) -> None:
        super().__init__(backend, budget=0, width=1, eos_token_id=eos_token_id)
