"""The one protocol every decode backend implements (torch, torch-graph, ONNX Runtime, TensorRT).

The decode loop (`jetflow_pl.decoding`) owns the algorithm (tree building, acceptance, budget, stopping);
a backend owns the compute and the caches. Requests live in slots (`max_batch` of them), each with its own
KV cache, tree and acceptance; one round over the decoding batch is `draft_batch` (ONE head forward) ->
per-depth log-probs per request, `verify_batch` (ONE target forward) -> target logits per tree node,
`commit_batch` -> keep each request's root + accepted rows and hand their tapped features to the head as
new context. A batch of one is slot 0: there is no separate single-sequence protocol. Every backend in this
package implements it through one bookkeeping class (`sequence.SequenceBackend`); the helpers below read
what a backend states about itself, so the loop and the cost profile ask the same questions the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from jetflow_pl.tree import DraftTree

#: Largest draft budget (tree nodes - 1) on a backend that states no limit of its own. The verify step
#: builds an `[N, past + N]` mask and runs N target rows at once; past ~1k nodes the speed-up is long
#: gone and the memory is not, so a larger budget is a typo rather than a setting.
DEFAULT_MAX_BUDGET = 1024
#: request slots of a batched backend unless it is told otherwise (slots cost nothing until used)
DEFAULT_MAX_BATCH = 64


@runtime_checkable
class DecodeBackend(Protocol):
    """Compute for the requests decoding together, one slot each (`max_batch` slots; a batch of one is
    slot 0). `slots` in `draft_batch` / `verify_batch` / `commit_batch` is the whole decoding batch (every
    prefilled slot not released), in any order; results follow that order."""

    @property
    def block_size(self) -> int:
        """Head block size B (drafts depths 1..B-1); 1 when the backend has no head."""
        ...

    @property
    def max_positions(self) -> int:
        """The target's context limit."""
        ...

    @property
    def max_batch(self) -> int:
        """Slots: the most requests that can decode at once."""
        ...

    def past_length(self, slot: int) -> int:
        """Positions in `slot`'s target KV cache."""
        ...

    def prefill(self, prompt_ids: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """Reset `slot` and run its whole prompt; return the last position's logits `[V]`."""
        ...

    def extend(self, slot: int, ids: torch.Tensor) -> torch.Tensor:
        """One prefill chunk: append `ids` to `slot` (not decoding yet); return the last row's logits."""
        ...

    def draft_batch(
        self, slots: Sequence[int], anchors: Sequence[int], depths: int | None = None
    ) -> list[torch.Tensor]:
        """ONE head forward on each request's `[anchor, MASK...]` at its KV length: per-depth log-probs
        `[D, V]` of depths 1..D per request, D = B-1, or at least `depths` of them when the caller needs
        no more (a causal head drafts depth d from the block's first d+1 rows alone, so the block can be
        cut there: `SequenceBackend`)."""
        ...

    def verify_batch(self, slots: Sequence[int], trees: Sequence[DraftTree]) -> list[torch.Tensor]:
        """ONE target forward over every request's tree: logits `[N_i, V]` per request."""
        ...

    def commit_batch(self, slots: Sequence[int], accepted: Sequence[Sequence[int]]) -> None:
        """Per request, keep its accepted root path's KV rows and queue their taps."""
        ...

    def release(self, slot: int) -> None:
        """Free `slot`'s KV rows now (the request finished or was cancelled)."""
        ...

    def refine(self, tree: DraftTree) -> torch.Tensor:
        """Optional (branch-conditioned refinement, slot 0): one head forward over the tree under the
        tree-causal mask; return log-probs `[N, V]` of each node's children given the node's own path."""
        ...


def max_budget(backend: DecodeBackend) -> int:
    """The largest budget `backend` can verify: `max_tree_nodes - 1` when it says (an engine's profile
    limit), else `DEFAULT_MAX_BUDGET`."""
    nodes = getattr(backend, "max_tree_nodes", None)
    return int(nodes) - 1 if nodes is not None else DEFAULT_MAX_BUDGET


def vocab_size(backend: DecodeBackend) -> int | None:
    """The target vocabulary size where the backend exposes it (`vocab_size`, or its `target`'s)."""
    for obj in (backend, getattr(backend, "target", None)):
        size = getattr(obj, "vocab_size", None)
        if isinstance(size, int):
            return size
    return None
