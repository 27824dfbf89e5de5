"""The one protocol between the decode round and whatever picks its draft budget.

Per generation (or per engine) the round calls `start(backend, max_batch)` once, then per round
`choose(RoundInfo) -> budget` before drafting and `observe(RoundResult)` after committing. Nothing else:
a policy that needs the tokens left or the round's wall time reads them from these two
records, so the loop never asks a policy what it supports. A batch of one is the batch case (`RoundInfo`
with one request). Round observers (benchmarks, logs) get the same `RoundResult`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from jetflow_pl.decoding.budget.acceptance import AcceptanceStats
from jetflow_pl.errors import UserInputError
from jetflow_pl.runtime.backend import DecodeBackend
from jetflow_pl.tree import DraftTree

__all__ = ["BudgetPolicy", "FixedBudget", "RoundInfo", "RoundObserver", "RoundResult"]


def _one_request() -> tuple[AcceptanceStats, ...]:
    return (AcceptanceStats([0]),)


@dataclass(frozen=True)
class RoundInfo:
    """What the decode loop knows before a round.

    requests: each request's own acceptance so far (`AcceptanceStats`), in batch order; one entry for a
        batch of one.
    remaining: the tokens each request may still produce (None: no bound); a tree yields a request at
        most that many.
    """

    requests: Sequence[AcceptanceStats] = field(default_factory=_one_request)
    remaining: Sequence[int] | None = None

    @property
    def batch(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class RoundResult:
    """One finished round: every request's tree, its accepted node ids (root first), the budget each was
    played at, and the round's wall time (draft, build, verify, acceptance, commit; None: not timed)."""

    trees: Sequence[DraftTree]
    accepted: Sequence[Sequence[int]]
    budgets: Sequence[int] = ()
    seconds: float | None = None

    @property
    def batch(self) -> int:
        return len(self.trees)

    @property
    def tree_budget(self) -> int | None:
        """The one tree size of the round, or None when its trees differ (a per-request budget, or a tree
        cut short by the context limit): such a round is no sample of any one budget's cost."""
        sizes = {t.budget for t in self.trees}
        return sizes.pop() if len(sizes) == 1 else None


#: something told about every round (a benchmark's recorder, a log): `DecodeRound(observers=[...])`
RoundObserver = Callable[[RoundResult], None]


@runtime_checkable
class BudgetPolicy(Protocol):
    """Picks the draft budget of each round (`SpeculativeGenerator(budget=policy)`).

    `max_budget`: the largest budget it may pick, checked against the backend up front (None: it caps
    itself in `start`). `start` runs before the first request is prefilled and may use the backend (e.g.
    to measure costs); `choose` gives the budget the round's trees share (a request with its own budget
    overrides it); `observe` gets the round's outcome.
    """

    max_budget: int | None

    def start(self, backend: DecodeBackend, max_batch: int = 1) -> None: ...

    def choose(self, info: RoundInfo) -> int: ...

    def observe(self, result: RoundResult) -> None: ...


@dataclass
class FixedBudget:
    """The same budget every round (0 = autoregressive)."""

    budget: int

    def __post_init__(self) -> None:
        if int(self.budget) < 0:
            raise UserInputError(f"budget must be >= 0, got {self.budget}")
        self.budget = int(self.budget)

    @property
    def max_budget(self) -> int:
        return self.budget

    def start(self, backend: DecodeBackend, max_batch: int = 1) -> None:
        pass

    def choose(self, info: RoundInfo) -> int:
        return self.budget

    def observe(self, result: RoundResult) -> None:
        pass
