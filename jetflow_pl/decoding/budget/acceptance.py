"""What a head's trees yield: accept lengths observed per budget, and the prior a head ships with.

Learning tau(k) costs nothing extra because of how trees are built (`tree.build_tree`): nodes are
inserted best-first, each parent before its children, and building stops the moment the budget is
reached, so the first k+1 nodes of a budget-K tree ARE the budget-k tree (same nodes, same order; the
depth cap `min(D, k)` never bites inside them because a node at depth d has d ancestors before it).
An acceptance walk moves along increasing node ids, and at each node it takes the first child (in
node order) carrying the target's token; in the budget-k prefix the children of a node are a prefix
of its children. So the walk on the budget-k tree is the walk on the budget-K tree cut at the first
node id > k, and one verified round at budget K tells the accept length of every budget k <= K
(`accept_length_at`). That holds for greedy acceptance and, drawing the same tokens, for sampling.
It does not hold for branch-conditioned refinement (a refined tree is a selection, not a prefix), so
`auto` refuses `refine_factor`.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Protocol

from jetflow_pl.decoding.budget.cost_profile import LADDER_NODES
from jetflow_pl.errors import UserInputError
from jetflow_pl.files import VersionedJsonFile

#: the budgets `auto` chooses among (capped by the backend and the cost profile): 0, 1, 2, 4, ..., 256
LADDER_BUDGETS = tuple(n - 1 for n in LADDER_NODES)
ACCEPTANCE_PROFILE_VERSION = 1
#: file name of an acceptance profile saved beside a head (`generate` reads it as the prior)
ACCEPTANCE_PROFILE_FILE = "acceptance_profile.json"


def accept_length_at(accepted: Sequence[int], budget: int) -> int:
    """Tokens the round would have committed (accepted + 1) had its tree held only the first `budget + 1`
    nodes: 1 + the accepted node ids <= budget (the ids increase along the path; see the module doc)."""
    return bisect_right(accepted, budget)


# --------------------------------------------------------------------------------------------------
# acceptance: observed and prior
# --------------------------------------------------------------------------------------------------


class PlayedRound(Protocol):
    """What `AcceptanceStats.observe_round` reads of a round (`policy.RoundResult` is one)."""

    @property
    def trees(self) -> Sequence[Any]: ...  # each a `DraftTree` (its `budget`)

    @property
    def accepted(self) -> Sequence[Sequence[int]]: ...


class AcceptanceStats:
    """Sums and counts of per-round accept lengths at each of `budgets` (the counterfactual ones too), and
    of each budget's gain over the next smaller one on the same rounds (`mean_gain`)."""

    def __init__(self, budgets: Sequence[int] = LADDER_BUDGETS) -> None:
        self.budgets = tuple(sorted(set(int(k) for k in budgets)))
        self.sums = [0.0] * len(self.budgets)
        self.square_sums = [0.0] * len(self.budgets)
        self.gain_sums = [0.0] * len(self.budgets)
        self.counts: list[float] = [0] * len(self.budgets)

    def observe(self, accepted: Sequence[int], tree_budget: int) -> None:
        """Record one verified round: `accepted` node ids (root first) of a tree of `tree_budget` drafts."""
        below = 1  # the accept length one budget down (a tree of no drafts commits the bonus token only)
        for i, k in enumerate(self.budgets):
            if k > tree_budget:
                break
            length = accept_length_at(accepted, k)
            self.sums[i] += length
            self.square_sums[i] += length * length
            self.gain_sums[i] += length - below
            self.counts[i] += 1
            below = length

    def observe_round(self, result: PlayedRound) -> None:
        """Record every tree of one round (a `RoundObserver`: `SpeculativeGenerator.record_acceptance`)."""
        for tree, accepted in zip(result.trees, result.accepted, strict=True):
            self.observe(accepted, tree.budget)

    def fade(self, memory: int) -> None:
        """Keep at most `memory` rounds' worth per budget, older ones counting less (means unchanged)."""
        for i, c in enumerate(self.counts):
            if c > memory:
                self.sums[i] *= memory / c
                self.square_sums[i] *= memory / c
                self.gain_sums[i] *= memory / c
                self.counts[i] = memory

    def mean(self, budget: int) -> float | None:
        """Mean accept length at `budget` (None if never observed)."""
        i = self.budgets.index(budget)
        return self.sums[i] / self.counts[i] if self.counts[i] else None

    def mean_gain(self, budget: int) -> float | None:
        """Mean of (accept length at `budget`) - (accept length at the next smaller budget) over the rounds
        that covered `budget` (None if never observed). A paired difference: both terms come from the same
        rounds, so it does not depend on which stretch of text those rounds happened to fall in."""
        i = self.budgets.index(budget)
        return self.gain_sums[i] / self.counts[i] if self.counts[i] else None

    def count(self, budget: int) -> float:
        return self.counts[self.budgets.index(budget)]

    def variance(self, budget: int) -> float | None:
        """Variance of the accept length at `budget` over the rounds seen (None below two rounds)."""
        i = self.budgets.index(budget)
        n = self.counts[i]
        if n < 2:
            return None
        mean = self.sums[i] / n
        return max(0.0, self.square_sums[i] / n - mean * mean)

    def to_profile(self, width: int, **meta: Any) -> AcceptanceProfile:
        """The observed budgets as an `AcceptanceProfile` (e.g. to save as the next run's prior)."""
        seen = [i for i, c in enumerate(self.counts) if c]
        if not seen:
            raise ValueError("no round was observed: nothing to build an acceptance profile from")
        return AcceptanceProfile(
            budgets=[self.budgets[i] for i in seen],
            tau=[self.sums[i] / self.counts[i] for i in seen],
            rounds=[round(self.counts[i]) for i in seen],
            width=int(width),
            **meta,
        )


@dataclass
class AcceptanceProfile(VersionedJsonFile):
    """Expected tokens per round tau(k) of a head at a few budgets k (the prior of `AutoBudget`).

    `at(k)` between measured budgets is the value at the largest measured budget <= k: tau is
    non-decreasing in k, so that is a lower bound and never makes an unmeasured budget look better.
    """

    FILE_KIND = "acceptance profile"
    FILE_VERSION = ACCEPTANCE_PROFILE_VERSION

    budgets: list[int]
    tau: list[float]
    rounds: list[int]
    width: int
    head: str = ""
    note: str = ""
    version: int = ACCEPTANCE_PROFILE_VERSION
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.budgets or not (len(self.budgets) == len(self.tau) == len(self.rounds)):
            raise UserInputError("an acceptance profile needs matching, non-empty budgets, tau and rounds")
        if any(b <= a for a, b in pairwise(self.budgets)):
            raise UserInputError(f"acceptance profile budgets must increase, got {self.budgets}")
        for k, t in zip(self.budgets, self.tau, strict=True):
            if not (math.isfinite(t) and 1.0 <= t <= k + 1 + 1e-9):
                raise UserInputError(f"acceptance profile tau({k}) = {t} is outside [1, {k + 1}]")

    def at(self, budget: int) -> float:
        i = bisect_right(self.budgets, budget) - 1
        return 1.0 if i < 0 else float(self.tau[i])

    def rounds_at(self, budget: int) -> int:
        i = bisect_right(self.budgets, budget) - 1
        return 0 if i < 0 else int(self.rounds[i])
