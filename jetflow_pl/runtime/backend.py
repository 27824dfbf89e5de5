"""The small protocol every decode backend implements (torch, ONNX Runtime, TensorRT).

The decode loop owns the algorithm (tree building, acceptance, stopping); a backend owns the compute and
the caches. One round is: `draft(anchor)` -> per-depth log-probs, `verify(tree)` -> target logits per
node, `commit(accepted)` -> keep root + accepted rows of the target KV cache and hand their tapped
features to the head as new context.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from jetflow_pl.tree import DraftTree


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
