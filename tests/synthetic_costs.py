"""Hand-written cost profiles for the budget-chooser tests (no timing: seconds are chosen ratios)."""

from __future__ import annotations

from jetflow_pl.decoding.budget.cost_profile import LADDER_NODES, CostProfile


def profile_of(rows: dict[int, dict[int, float]], kv_len: int = 256) -> CostProfile:
    """A profile from {batch size: {tree size N: seconds of one whole round}} (batch 1 required)."""
    sizes = sorted(rows)
    return CostProfile(
        fingerprint={"machine": "synthetic"},
        batch_sizes=sizes,
        nodes=[sorted(rows[b]) for b in sizes],
        round_s=[[rows[b][n] for n in sorted(rows[b])] for b in sizes],
        kv_len=kv_len,
        repeats=1,
    )


def batched_profile(batch_slope: dict[int, float], slope: float = 0.02, draft: float = 0.2) -> CostProfile:
    """t(1) = 1 s, a round of N nodes 1 + slope (N - 1) s plus the draft `draft` s; per measured B:
    t(B, 1) = 0.5 B s (batching pays for AR), a round of B trees of N nodes t(B, 1) (1 + batch_slope[B]
    (N - 1)) plus the batched draft `draft` t(B, 1). An empty `batch_slope`: batch 1 alone."""
    rows = {1: {n: 1.0 + slope * (n - 1) + (draft if n > 1 else 0.0) for n in LADDER_NODES}}
    for b, s in batch_slope.items():
        rows[b] = {n: 0.5 * b * (1.0 + s * (n - 1) + (draft if n > 1 else 0.0)) for n in LADDER_NODES}
    return profile_of(rows)
