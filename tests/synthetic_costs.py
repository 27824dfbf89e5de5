"""Hand-written cost profiles for the budget-chooser tests (no timing: seconds are chosen ratios)."""

from __future__ import annotations

from jetflow_pl.decoding.budget.cost_profile import LADDER_NODES, CostProfile


def batched_profile(batch_slope: dict[int, float], slope: float = 0.02, draft: float = 0.2) -> CostProfile:
    """t(1) = 1 s, t(N)/t(1) = 1 + slope (N - 1), the draft `draft` s; per measured B: t(B, 1) = 0.5 B s
    (batching pays for AR), t(B, N)/t(B, 1) = 1 + batch_slope[B] (N - 1), the batched draft `draft` t(B, 1),
    no build time. An empty `batch_slope`: a profile without a batch dimension."""
    sizes = sorted(batch_slope)
    return CostProfile(
        fingerprint={"machine": "synthetic"},
        nodes=list(LADDER_NODES),
        verify_s=[1.0 + slope * (n - 1) for n in LADDER_NODES],
        build_s=[0.0] * len(LADDER_NODES),
        draft_s=draft,
        kv_len=256,
        repeats=1,
        batch_sizes=sizes,
        batch_nodes=[list(LADDER_NODES) for _ in sizes],
        batch_verify_s=[[0.5 * b * (1.0 + batch_slope[b] * (n - 1)) for n in LADDER_NODES] for b in sizes],
        batch_build_s=[[0.0] * len(LADDER_NODES) for _ in sizes],
        batch_draft_s=[0.5 * b * draft for b in sizes],
    )
