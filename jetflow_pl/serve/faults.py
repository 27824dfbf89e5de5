"""`FaultGuard`: one request's NaN fails that request, not the batch it decodes in.

The decode loop refuses non-finite logits (`errors.check_finite`: a lossless decoder must not pick a
token from NaN) by raising from inside the round, and a round is one forward for the whole batch: a raise
there would end every request in flight, and an interrupted round leaves the backend between its draft
and its commit (the head has consumed the requests' new context, the verify is staged), so the others
could not even be resumed. A server must instead fail the one request and keep the rest.

The guard sits between the engine and its batch backend and checks each request's outputs (prompt
logits, draft log-probs, verify logits) where the backend returns them, per slot, with the loop's own
criterion (NaN or +inf). A slot whose output is not finite is recorded at once, while the slot still
belongs to its request (`locate(slot)` names the request: the engine may retire it later in the same
step), with the reason; its output is replaced by zeros so the round can complete for everyone else. That
replacement never reaches a client: the driver cancels every recorded request right after the step
(its KV is freed, its tokens are discarded) and answers it with the error. The other requests' tensors
are passed through untouched, so their tokens are exactly those of a run without the faulty one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

__all__ = ["FaultGuard"]


def _finite(x: torch.Tensor) -> bool:
    """The decode loop's criterion (`errors.check_finite`): no NaN and no +inf (-inf log-probs are fine)."""
    return not bool(x.isnan().any() | x.isposinf().any())


class FaultGuard:
    """The engine's batch backend with per-request finiteness checks (see the module docstring).

    Everything else is delegated to `inner` (the generator's backend), so the engine
    schedules exactly as without the guard.
    """

    def __init__(self, inner: Any, locate: Callable[[int], Hashable] | None = None) -> None:
        self.inner = inner
        #: slot -> the request holding it now (default: the slot itself)
        self.locate = locate
        #: request (as `locate` names it) -> why it failed, since the last `take_faults()`
        self.faults: dict[Hashable, str] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def take_faults(self) -> dict[Hashable, str]:
        """The requests that produced non-finite outputs since the last call (and clear the record)."""
        faults, self.faults = self.faults, {}
        return faults

    def _check(self, slot: int, x: torch.Tensor, what: str) -> torch.Tensor:
        if _finite(x):
            return x
        key = self.locate(slot) if self.locate is not None else slot
        self.faults.setdefault(
            key,
            f"{what} produced NaN/inf for this request; the request was stopped (the others go on)",
        )
        return torch.zeros_like(x)

    def prefill(self, prompt_ids: torch.Tensor, slot: int = 0) -> torch.Tensor:
        return self._check(slot, self.inner.prefill(prompt_ids, slot), "the target (prompt logits)")

    def extend(self, slot: int, ids: torch.Tensor) -> torch.Tensor:
        return self._check(slot, self.inner.extend(slot, ids), "the target (prompt logits)")

    def draft_batch(
        self, slots: Sequence[int], anchors: Sequence[int], depths: int | None = None
    ) -> list[torch.Tensor]:
        out = self.inner.draft_batch(slots, anchors, depths)
        return [self._check(s, x, "the draft head") for s, x in zip(slots, out, strict=True)]

    def verify_batch(self, slots: Sequence[int], trees: Sequence[Any]) -> list[torch.Tensor]:
        out = self.inner.verify_batch(slots, trees)
        return [self._check(s, x, "the target (verify logits)") for s, x in zip(slots, out, strict=True)]
