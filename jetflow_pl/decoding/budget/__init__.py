"""The draft budget of each round: a fixed number or `auto`, behind one protocol.

- `policy`: the protocol the decode round speaks (`start`, `choose(RoundInfo)`, `observe(RoundResult)`)
  and `FixedBudget`;
- `acceptance`: what trees yield (`AcceptanceStats` per round, the `AcceptanceProfile` a head ships);
- `cost_profile`: what rounds cost on this machine (`CostProfile`, cached per machine and model);
- `measure_costs`: measuring one through the decode loop's own round, and finding the one that applies;
- `auto`: `AutoBudget`, the budget with the best expected tokens per unit of cost, AR when none pays.
"""

from __future__ import annotations

from jetflow_pl.decoding.budget.acceptance import (
    ACCEPTANCE_PROFILE_FILE,
    LADDER_BUDGETS,
    AcceptanceProfile,
    AcceptanceStats,
    accept_length_at,
)
from jetflow_pl.decoding.budget.auto import AutoBudget
from jetflow_pl.decoding.budget.policy import BudgetPolicy, FixedBudget, RoundInfo, RoundObserver, RoundResult
from jetflow_pl.errors import UserInputError

__all__ = [
    "ACCEPTANCE_PROFILE_FILE",
    "LADDER_BUDGETS",
    "AcceptanceProfile",
    "AcceptanceStats",
    "AutoBudget",
    "BudgetPolicy",
    "FixedBudget",
    "RoundInfo",
    "RoundObserver",
    "RoundResult",
    "accept_length_at",
    "resolve_budget",
]


def resolve_budget(budget: int | str | BudgetPolicy) -> BudgetPolicy:
    """`SpeculativeGenerator`'s `budget` argument as a policy: an int -> `FixedBudget`, "auto" ->
    `AutoBudget()` (cost profile from this machine's cache, no prior), a policy as it is."""
    wrong = f"budget must be an int >= 0, 'auto' or a BudgetPolicy, got {budget!r}"
    if isinstance(budget, bool):
        raise UserInputError(wrong)
    if isinstance(budget, int):
        return FixedBudget(budget)
    if isinstance(budget, str):
        if budget.strip().lower() == "auto":
            return AutoBudget()
        raise UserInputError(wrong)
    if isinstance(budget, BudgetPolicy):
        return budget
    raise UserInputError(f"budget must be an int >= 0, 'auto' or a BudgetPolicy, got {type(budget).__name__}")
