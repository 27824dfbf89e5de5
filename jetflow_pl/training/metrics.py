"""Training metrics: per-depth top-1 agreement and the simulated acceptance length.

Both accumulate per-depth counts (`correct[d]`, `total[d]`: rows at depth `d+1` whose draft argmax equals
the target's argmax) and reduce by summation, so they are exact under DDP and across batches.

The simulated acceptance length is `1 + sum_k prod_{j<=k} a_j` where `a_j` is the per-depth agreement
RATE pooled over everything seen (docs/DESIGN.md section 3). It multiplies marginal per-depth rates, i.e. it
treats the depths as independent; it is a cheap proxy for tau (a chain-accepting walk on a single draft
path of length `num_depths`), not the real acceptance length measured by speculative decoding.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric


def simulated_acceptance_length(rates: torch.Tensor) -> torch.Tensor:
    """`[D]` per-depth agreement rates -> scalar `1 + sum_k prod_{j<=k} rates_j`."""
    rates = torch.as_tensor(rates, dtype=torch.float32)
    if rates.numel() == 0:
        return torch.ones((), device=rates.device)
    return 1.0 + torch.cumprod(rates.reshape(-1), dim=0).sum()


class DepthAgreement(Metric):
    """Per-depth top-1 agreement rate `[num_depths]` (0 where a depth has no rows yet).

    `update(correct, total)` takes per-depth counts `[num_depths]` (e.g. `distill_step`'s `agree_correct`
    and `agree_total`).
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, num_depths: int, **kwargs) -> None:
        super().__init__(**kwargs)
        if num_depths < 1:
            raise ValueError(f"num_depths must be >= 1, got {num_depths}")
        self.num_depths = int(num_depths)
        self.add_state(
            "correct", default=torch.zeros(self.num_depths, dtype=torch.long), dist_reduce_fx="sum"
        )
        self.add_state("total", default=torch.zeros(self.num_depths, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, correct: torch.Tensor, total: torch.Tensor) -> None:
        correct = torch.as_tensor(correct, device=self.correct.device).reshape(-1).long()
        total = torch.as_tensor(total, device=self.total.device).reshape(-1).long()
        if correct.shape != (self.num_depths,) or total.shape != (self.num_depths,):
            raise ValueError(
                f"correct/total must have {self.num_depths} entries, got {tuple(correct.shape)}/{tuple(total.shape)}"
            )
        if bool((correct > total).any()) or bool((correct < 0).any()):
            raise ValueError("need 0 <= correct <= total at every depth")
        self.correct += correct
        self.total += total

    def rates(self) -> torch.Tensor:
        return torch.where(
            self.total > 0,
            self.correct.float() / self.total.clamp_min(1).float(),
            torch.zeros_like(self.total, dtype=torch.float32),
        )

    def compute(self) -> torch.Tensor:
        return self.rates()


class SimulatedAcceptanceLength(DepthAgreement):
    """`1 + sum_k prod_{j<=k} a_j` from the pooled per-depth agreement rates `a_j` (see module docstring).

    Same `update(correct, total)` as `DepthAgreement`; `compute()` returns a scalar in `[1, 1 + num_depths]`.
    """

    def compute(self) -> torch.Tensor:
        return simulated_acceptance_length(self.rates())
