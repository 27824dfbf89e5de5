"""The small protocol every decode backend implements (torch, torch-graph, ONNX Runtime, TensorRT).

The decode loop (`jetflow_pl.decoding`) owns the algorithm (tree building, acceptance, budget, stopping);
a backend owns the compute and the caches. One round is: `draft(anchor)` -> per-depth log-probs,
`verify(tree)` -> target logits per node, `commit(accepted)` -> keep root + accepted rows of the target KV
cache and hand their tapped features to the head as new context. Every backend in this package
implements it through one bookkeeping class (`sequence.SequenceBackend`); the helpers below read what a
backend states about itself, so the loop and the cost profile ask the same questions the same way.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from jetflow_pl.tree import DraftTree

#: Largest draft budget (tree nodes - 1) on a backend that states no limit of its own. The verify step
#: builds an `[N, past + N]` mask and runs N target rows at once; past ~1k nodes the speed-up is long
#: gone and the memory is not, so a larger budget is a typo rather than a setting.
DEFAULT_MAX_BUDGET = 1024


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

    def draft(self, anchor_token: int) -> torch.Tensor:
        """One head forward on `[anchor, MASK...]` at `past_len`; return log-probs `[B-1, V]`."""
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
