"""`SequenceBackend`: the one KV/tap bookkeeping of every decode backend (torch, graphs, ONNX Runtime,
TensorRT); subclasses only run the two forwards.

A round (`backend.DecodeBackend`) is the same on every runtime:

* `prefill(prompt)`: reset, run the prompt through the target as a chain (in chunks of
  `max_prefill_rows` where a runtime's profile bounds the rows per forward), keep every row, queue the
  prompt's taps for the head; return the last position's logits.
* `draft(anchor)`: the block `[anchor, MASK * (B-1)]` at `past_len + k`; the head forward reads the queued
  taps (each committed position is projected into the head's KV cache exactly once) and returns per-depth
  log-probs `[B-1, V]` (a runtime that keeps the head's top-k scatters it into a `-inf` row first).
* `verify(tree)`: one target forward over the tree's nodes at `past_len + depth` under the ancestor mask;
  the nodes' K/V are staged, their taps held back.
* `commit(accepted)`: keep the committed rows plus the root path's, in that order, and queue their taps.

The state of the sequence is its slot in two `KVStore`s (target, head) plus a `TapQueue`; the store kind
is the runtime's choice (`kv_store.py`). A subclass sets them up and implements `_forward_target` and
`_forward_head`; the calls, their order and every check are here. A batched backend keeps one such state
per request slot and runs the same forwards over `B` requests at once.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
from torch import Tensor

from jetflow_pl.runtime.kv_store import KV, KVStore
from jetflow_pl.tree import DraftTree

__all__ = ["SequenceBackend", "TapQueue", "topk_to_dense"]


class TapQueue:
    """Tapped target features of committed rows that the head has not read yet, with their positions.

    Without `capacity` the queue keeps the pushed tensors and concatenates them when read (the caller
    hands over tensors it does not overwrite). With `capacity` it copies them into one preallocated buffer
    of `capacity` rows (for runtimes whose outputs live in reused buffers, and that allocate nothing while
    decoding); more rows than that is the head's per-forward limit, refused in one `ValueError`.
    """

    def __init__(
        self,
        capacity: int | None = None,
        features: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.capacity = None if capacity is None else operator.index(capacity)
        self._chunks: list[tuple[Tensor, Tensor]] = []
        self._rows = 0
        if self.capacity is not None:
            if features is None:
                raise ValueError("a TapQueue with a capacity needs the feature size")
            self._features = int(features)
            self._taps = torch.empty(self.capacity * self._features, dtype=dtype, device=device)
            self._positions = torch.empty(self.capacity, dtype=torch.int64, device=device)
            self._arange = torch.arange(self.capacity, dtype=torch.int64, device=device)

    def __len__(self) -> int:
        return self._rows

    def clear(self) -> None:
        self._chunks.clear()
        self._rows = 0

    def push(self, taps: Tensor, first_position: int) -> None:
        """Queue taps `[1, k, F]` of committed rows at positions `first_position .. first_position + k - 1`."""
        k = int(taps.shape[1])
        start = self._rows
        if self.capacity is None:
            positions = torch.arange(first_position, first_position + k, device=taps.device)
            self._chunks.append((taps, positions))
        else:
            if start + k > self.capacity:
                raise ValueError(
                    f"{start + k} context rows wait for the head, which takes at most {self.capacity} per forward"
                )
            f = self._features
            self._taps[start * f : (start + k) * f].view(1, k, f).copy_(taps)
            torch.add(self._arange[:k], first_position, out=self._positions[start : start + k])
        self._rows = start + k

    def peek(self) -> tuple[Tensor, Tensor] | None:
        """(taps `[1, T, F]`, positions `[1, T]`) of every queued row, or None; `clear()` once consumed.

        With a capacity these are views of the buffer, valid until the next `push`."""
        if self._rows == 0:
            return None
        if self.capacity is not None:
            t, f = self._rows, self._features
            return self._taps[: t * f].view(1, t, f), self._positions[:t].view(1, t)
        if len(self._chunks) > 1:  # fold, so a second peek does not concatenate again
            taps = torch.cat([c[0] for c in self._chunks], dim=1)
            positions = torch.cat([c[1] for c in self._chunks])
            self._chunks = [(taps, positions)]
        taps, positions = self._chunks[0]
        return taps, positions.unsqueeze(0)


def topk_to_dense(values: Tensor, ids: Tensor, vocab_size: int) -> Tensor:
    """Per-row top-k log-probs `[Q, K]` (+ their ids) -> `[Q, V]` host rows, `-inf` outside the top-k:
    what the tree builder reads (it expands at most `K` children per node, see `check_width`)."""
    dense = torch.full((values.shape[0], vocab_size), float("-inf"))
    dense.scatter_(1, ids.to(torch.int64).cpu(), values.float().cpu())
    return dense


class SequenceBackend:
    """The decode protocol over one sequence (slot 0 of the stores); see the module docstring.

    Subclasses call `__init__` with their stores and define `block_size`, `mask_token_id`,
    `max_positions`, `vocab_size` (and `topk` / `max_tree_nodes` / `max_prefill_rows` where the runtime
    has such a limit), `_forward_target` and `_forward_head`.
    """

    def __init__(
        self,
        kv: KVStore,
        head_kv: KVStore | None,
        taps: TapQueue | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.kv = kv
        self.head_kv = head_kv
        self.taps = taps if taps is not None else TapQueue()
        self._device = torch.device(device)
        self._verified = False  # a verify is staged and waits for its commit
        self._tree_taps: Tensor | None = None  # that verify's taps (held back until commit)
        self._reset()

    # ------------------------------------------------------------------ what a runtime states
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def past_len(self) -> int:
        """Positions held in the target KV cache (committed tokens, excluding the pending anchor)."""
        return self.kv.length()

    @property
    def has_head(self) -> bool:
        return self.head_kv is not None

    @property
    def topk(self) -> int | None:
        """Tokens the head keeps per depth (None: the whole vocabulary)."""
        return None

    @property
    def max_tree_nodes(self) -> int | None:
        """Largest tree one verify takes (None: no limit of the runtime's own)."""
        return None

    @property
    def max_prefill_rows(self) -> int | None:
        """Most prompt rows per prefill forward (None: the whole prompt at once)."""
        return None

    def check_width(self, width: int) -> None:
        """A head that keeps `topk` tokens per depth cannot feed a wider tree."""
        topk = self.topk
        if topk is not None and width > topk:
            raise ValueError(
                f"tree width {width} exceeds the engine's top-k ({topk}): re-export with --topk >= {width}"
            )

    # ------------------------------------------------------------------ the two forwards (subclasses)
    def _forward_target(
        self, ids: Tensor, positions: Tensor, tree: DraftTree | None, last_only: bool
    ) -> tuple[Tensor, Tensor | None, KV | None]:
        """One target forward over `n` new rows (`ids`, `positions`: `[n]`) after the committed KV rows,
        under `tree`'s ancestor mask (None: a chain). Returns (logits `[n, V]`, or at least the last row's
        when `last_only`; taps `[1, n, F]` or None; `present` for the store, or None when the store was
        appended to by the forward itself)."""
        raise NotImplementedError

    def _forward_head(
        self, block_ids: Tensor, block_positions: Tensor, context: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, KV | None]:
        """One head forward: new context taps `[1, T, F]` at positions `[1, T]`, then the block rows
        (`[1, B]` ids and positions). Returns (per-depth log-probs `[B-1, V]`, `present` or None)."""
        raise NotImplementedError

    def _device_scope(self) -> Any:
        """Context every step runs in (a runtime that must make its device current overrides it)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ the protocol
    def _reset(self) -> None:
        self.kv.reset()
        if self.head_kv is not None:
            self.head_kv.reset()
        self.taps.clear()  # a previous sequence's last commit leaves taps queued for a draft never made
        self._verified, self._tree_taps = False, None

    def _queue(self, taps: Tensor | None, first_position: int) -> None:
        if self.head_kv is not None and taps is not None:
            self.taps.push(taps, first_position)

    @torch.no_grad()
    def prefill(self, prompt_ids: Tensor) -> Tensor:
        """Reset all state, run the prompt `[T]` through the target; return the last position's logits `[V]`."""
        ids = torch.as_tensor(prompt_ids).reshape(-1).to(torch.long)
        total = int(ids.numel())
        if total == 0:
            raise ValueError("prompt is empty: at least one token is needed to start decoding")
        if total > self.max_positions:
            raise ValueError(f"prompt of {total} tokens exceeds the context limit of {self.max_positions}")
        self._reset()
        with self._device_scope():
            ids = ids.to(self.device)
            chunk = self.max_prefill_rows or total
            for start in range(0, total, chunk):
                part = ids[start : start + chunk]
                n = int(part.numel())
                positions = torch.arange(start, start + n, device=self.device)
                logits, taps, present = self._forward_target(part, positions, None, last_only=True)
                self.kv.stage(n, present)
                self.kv.commit()
                self._queue(taps, start)
            return logits[-1]

    @torch.no_grad()
    def draft(self, anchor_token: int) -> Tensor:
        """One head forward on `[anchor, MASK...]` at `past_len`; return log-probs `[B-1, V]`."""
        if self.head_kv is None:
            raise RuntimeError("this backend has no draft head: only autoregressive decoding is possible")
        context = self.taps.peek()
        if context is None:
            raise RuntimeError("draft() needs new context rows: call prefill() or commit() first")
        b = self.block_size
        with self._device_scope():
            block = torch.full((1, b), self.mask_token_id, dtype=torch.long, device=self.device)
            block[0, 0] = anchor_token
            positions = (self.past_len + torch.arange(b, device=self.device)).unsqueeze(0)
            logprobs, present = self._forward_head(block, positions, context)
            self.head_kv.stage(int(context[0].shape[1]), present)
            self.head_kv.commit()
            self.taps.clear()
        return logprobs

    @torch.no_grad()
    def verify(self, tree: DraftTree) -> Tensor:
        """One target forward over every tree node under the tree-causal mask; return logits `[N, V]`."""
        with self._device_scope():
            logits, taps, present = self._forward_target(
                tree.tokens, tree.position_ids(self.past_len), tree, last_only=False
            )
            self.kv.stage(tree.num_nodes, present)
        self._verified, self._tree_taps = True, taps
        return logits

    @torch.no_grad()
    def commit(self, accepted: list[int]) -> None:
        """Keep the KV rows of the accepted root path (node ids, root first); queue their taps for the head."""
        if not self._verified:
            raise RuntimeError("commit() without a preceding verify()")
        taps, past = self._tree_taps, self.past_len
        keep = torch.as_tensor(accepted, dtype=torch.long).reshape(-1)  # host: the stores check it there
        with self._device_scope():
            self.kv.commit(keep)
            if taps is not None:
                self._queue(taps.index_select(1, keep.to(taps.device)), past)
        self._verified, self._tree_taps = False, None
