"""The small protocols every decode backend implements (torch, torch-graph, ONNX Runtime, TensorRT).

The decode loop (`jetflow_pl.decoding`) owns the algorithm (tree building, acceptance, budget, stopping);
a backend owns the compute and the caches. One round is: `draft(anchor)` -> per-depth log-probs,
`verify(tree)` -> target logits per node, `commit(accepted)` -> keep root + accepted rows of the target KV
cache and hand their tapped features to the head as new context. `DecodeBackend` is that round for one
sequence; `BatchDecodeBackend` is the same round for a batch of requests, each in its own slot with its
own tree, KV length and acceptance (one head forward and one verify forward for all of them). Every
backend in this package implements both through one bookkeeping class (`sequence.SequenceBackend`: the
batch-1 calls are slot 0 of the batched ones); the helpers below read what a backend states about
itself, so the loop and the cost profile ask the same questions the same way.
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
    """Compute for one sequence (batch 1) of speculative or autoregressive decoding."""

    @property
    def block_size(self) -> int:
        """Head block size B (drafts depths 1..B-1); 1 when the backend has no head."""
        ...

    @property
    def past_len(self) -> int:
        """Positions held in the target KV cache (committed tokens, excluding the pending anchor)."""
        ...

    @property
    def max_positions(self) -> int:
        """The target's context limit."""
        ...

    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """Reset all state, run the prompt `[T]` through the target; return the last position's logits `[V]`."""
        ...

    def draft(self, anchor_token: int, depths: int | None = None) -> torch.Tensor:
        """One head forward on `[anchor, MASK...]` at `past_len`; return log-probs `[D, V]` of depths 1..D:
        D = B-1, or at least `depths` of them when the caller needs no more (a causal head drafts depth
        d from the block's first d+1 rows alone, so the block can be cut there: `SequenceBackend`)."""
        ...

    def verify(self, tree: DraftTree) -> torch.Tensor:
        """One target forward over every tree node under the tree-causal mask; return logits `[N, V]`."""
        ...

    def refine(self, tree: DraftTree) -> torch.Tensor:
        """Optional (branch-conditioned refinement): one head forward over the tree under the tree-causal
        mask; return log-probs `[N, V]` of each node's children given the node's actual path."""
        ...

    def commit(self, accepted: list[int]) -> None:
        """Keep the KV rows of the accepted root path (node ids, root first); queue their taps for the head."""
        ...


@runtime_checkable
class BatchDecodeBackend(Protocol):
    """Compute for a batch of requests, one slot each (`max_batch` slots): the round of `DecodeBackend`
    over the decoding batch. `slots` in `draft_batch` / `verify_batch` / `commit_batch` is the whole
    decoding batch (every prefilled slot not released), in any order; results follow that order."""

    @property
    def block_size(self) -> int: ...

    @property
    def max_positions(self) -> int: ...

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
        """ONE head forward: per-depth log-probs `[D, V]` per request (`depths`: as `draft`)."""
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
