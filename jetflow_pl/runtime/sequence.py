"""`SequenceBackend`: the one KV/tap bookkeeping of every decode backend (torch, graphs, ONNX Runtime,
TensorRT), for one sequence or a batch of them; subclasses only run the two forwards.

A round is the same on every runtime and every batch size (`backend.DecodeBackend`: calls over the list
of slots decoding together; one request is slot 0):

* `prefill(prompt, slot)`: reset the slot, run the prompt through the target as a chain (in chunks of
  `max_prefill_rows` where a runtime's profile bounds the rows per forward; `extend` is one chunk, so a
  scheduler can interleave a joining request's prefill with the others' rounds), keep every row, queue
  the prompt's taps for the head; return the last position's logits. A slot is prefilled on its own.
* `draft_batch(slots, anchors, depths)`: per request the block `[anchor, MASK * (B-1)]` at `past_len + k`;
  ONE head forward over every request reads each one's queued taps (each committed position is projected
  into the head's KV cache exactly once; requests with fewer new rows are padded and the padding is
  invisible) and returns per-depth log-probs `[B-1, V]` per request (a runtime that keeps the head's
  top-k scatters it into a `-inf` row first). With `depths` and a causal head the block is cut to its
  first `depths + 1` rows: under the causal in-block mask row d sees rows 0..d only, so depths 1..`depths`
  come out the same (up to the float rounding of other GEMM shapes) while the head's layers and its
  lm_head run over fewer rows; a tree of budget k is never deeper than k, so a small budget pays for a
  short draft only. A bidirectional head's rows see the whole block: it always drafts all of it.
* `verify_batch(slots, trees)`: ONE target forward over every request's tree (own size, own KV length:
  TensorRT-LLM's packed mask, generation lengths and position offsets, `jetflow_pl.masks.pack_tree_batch`)
  at `past_len + depth`; the nodes' K/V are staged, their taps held back.
* `commit_batch(slots, accepted)`: per request, keep the committed rows plus its root path's, in that
  order (only the kept rows move, `KVGroup.commit`), and queue their taps.
* `release(slot)`: a finished request's rows are freed at once; the batch stays dense.

The state of a request is its slot in two `KVStore`s (target, head) plus a `TapQueue`; the store kind is
the runtime's choice (`kv_store.py`). Slots that decode together are the rows of the stores' batch group
(`KVStore.join`); the batch-1 protocol (`prefill` / `draft` / `verify` / `commit`) is the same code on
slot 0 alone. A subclass sets the stores up and implements `_forward_target` and `_forward_head` (one
forward over the rows of a group, `TargetStep` / `HeadStep`); the calls, their order and every check are
here.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from jetflow_pl.masks import TreeBatchMasks, chain_mask, pack_tree_batch
from jetflow_pl.runtime.kv_store import KV, KVGroup, KVStore
from jetflow_pl.tree import DraftTree

__all__ = ["HeadStep", "SequenceBackend", "TapQueue", "TargetStep", "topk_to_dense"]


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
    """Per-row top-k log-probs `[..., Q, K]` (+ their ids) -> `[..., Q, V]` host rows, `-inf` outside the
    top-k: what the tree builder reads (it expands at most `K` children per node, see `check_width`)."""
    lead = values.shape[:-1]
    dense = torch.full((*lead, vocab_size), float("-inf"))
    dense.scatter_(-1, ids.to(torch.int64).cpu(), values.float().cpu())
    return dense


@dataclass
class TargetStep:
    """One target forward over the `R` rows of a KV group: `N` new rows per request after its committed
    ones (a tree, or a prompt chunk as a chain).

    Attributes:
        ids, positions: `[R, N]` long on the device (padding rows carry the root token at the row's
            `past_length`: valid values whose outputs nobody reads).
        past_lengths: int32 `[R]` (host): committed rows of each request; the group's padded length `P` is
            their maximum, rows `[past_lengths[r], P)` are padding and never visible.
        trees: the requests' trees in row order (None: one prompt chunk, a chain over all `N` rows).
        last_only: only the last row's logits are read (a prefill chunk).
        masks (derived): TensorRT-LLM's spec-decoding tensors (`packed_mask [R, N, W]`,
            `generation_lengths [R]`, `position_offsets [R, N]`), what the graphs take.
    """

    ids: Tensor
    positions: Tensor
    past_lengths: Tensor
    trees: list[DraftTree] | None = None
    last_only: bool = False

    @property
    def num_rows(self) -> int:
        return int(self.ids.shape[1])

    @property
    def chain(self) -> bool:
        """A prompt chunk of one alone slot: every row a chain over all `N` rows, nothing padded."""
        return self.trees is None

    @cached_property
    def masks(self) -> TreeBatchMasks:
        n = self.num_rows
        if self.trees is None:
            lengths = torch.tensor([n], dtype=torch.int32)
            return TreeBatchMasks(chain_mask(n).unsqueeze(0), lengths, torch.arange(n).unsqueeze(0))
        if len(self.trees) == 1:  # the batch-1 step: no padding
            tree = self.trees[0]
            lengths = torch.tensor([n], dtype=torch.int32)
            return TreeBatchMasks(tree.packed_mask().unsqueeze(0), lengths, tree.depths.unsqueeze(0))
        return pack_tree_batch(self.trees)


@dataclass
class HeadStep:
    """One head forward over the `R` rows of the head's KV group: each request's new context taps, then
    its draft block.

    Attributes:
        block_ids, block_positions: `[R, Q]` (`[anchor, MASK...]` at `past_len + k`).
        context_taps: `[R, T, F]`, rows at or past a request's `context_lengths` are zero padding.
        context_positions: `[R, T]` (padding rows repeat a valid position).
        context_lengths: int32 `[R]` (host): new context rows per request.
        past_lengths: int32 `[R]` (host): the head cache's committed rows per request (padded to their max).
    """

    block_ids: Tensor
    block_positions: Tensor
    context_taps: Tensor
    context_positions: Tensor
    context_lengths: Tensor
    past_lengths: Tensor

    @property
    def dense(self) -> bool:
        """No padding anywhere: every request has the longest cache and the most new rows."""
        t = int(self.context_taps.shape[1])
        return bool((self.context_lengths == t).all()) and bool(
            (self.past_lengths == self.past_lengths.max()).all()
        )


def _chain_step(ids: Tensor, start: int, device: torch.device) -> TargetStep:
    """A prompt chunk of one alone slot: a chain after `start` committed rows."""
    n = int(ids.numel())
    return TargetStep(
        ids=ids.reshape(1, -1).to(device, torch.long),
        positions=torch.arange(start, start + n, device=device).unsqueeze(0),
        past_lengths=torch.tensor([start], dtype=torch.int32),
        last_only=True,
    )


def _tree_step(trees: Sequence[DraftTree], past_lengths: Tensor, device: torch.device) -> TargetStep:
    """The trees of a group's rows (row order) as one padded verify step."""
    trees = list(trees)
    if len(trees) == 1:
        ids = trees[0].tokens.unsqueeze(0)
        positions = trees[0].position_ids(int(past_lengths[0])).unsqueeze(0)
    else:
        n = max(t.num_nodes for t in trees)
        ids = torch.stack([torch.cat([t.tokens, t.tokens[:1].expand(n - t.num_nodes)]) for t in trees])
        depths = torch.stack([torch.cat([t.depths, t.depths.new_zeros(n - t.num_nodes)]) for t in trees])
        positions = past_lengths.to(torch.long).unsqueeze(1) + depths
    return TargetStep(ids.to(device), positions.to(device), past_lengths, trees)


class SequenceBackend:
    """The decode protocol over one sequence (slot 0) or a batch of them; see the module docstring.

    Subclasses call `__init__` with their stores and define `block_size`, `mask_token_id`,
    `max_positions`, `vocab_size` (and `topk` / `max_tree_nodes` / `max_prefill_rows` where the runtime
    has such a limit), `_forward_target` and `_forward_head`. `taps` is slot 0's tap queue (a runtime that
    preallocates gives its own); the other slots get a plain `TapQueue` when first used.
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
        self._queues: dict[int, TapQueue] = {0: taps if taps is not None else TapQueue()}
        self._device = torch.device(device)
        # slots whose verify is staged and waits for its commit -> that verify's taps (held back until then)
        self._verified: dict[int, Tensor | None] = {}
        self._reset()

    # ------------------------------------------------------------------ what a runtime states
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def taps(self) -> TapQueue:
        """Slot 0's queue of committed rows' taps that the head has not read yet."""
        return self._queues[0]

    def queue(self, slot: int) -> TapQueue:
        """The tap queue of `slot`."""
        q = self._queues.get(slot)
        if q is None:
            self.kv.group(slot)  # checks the slot
            q = self._queues[slot] = TapQueue()
        return q

    @property
    def past_len(self) -> int:
        """Positions held in slot 0's target KV cache (committed tokens, excluding the pending anchor)."""
        return self.kv.length(0)

    def past_length(self, slot: int) -> int:
        """Positions held in `slot`'s target KV cache."""
        return self.kv.length(slot)

    @property
    def max_batch(self) -> int:
        """Requests that can decode in one batched round (the stores' slots; 1 for a batch-1 runtime)."""
        return int(self.kv.num_slots)

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
    def _forward_target(self, step: TargetStep, group: KVGroup) -> tuple[Tensor, Tensor | None, KV | None]:
        """One target forward over `step.num_rows` new rows per row of `group`, after each row's committed
        KV rows, under `step.masks`. Returns (logits `[R, N, V]`, or at least the last row's when
        `step.last_only`; taps `[R, N, F]` or None; `present` for the group, or None when the forward
        appended to the group's cache itself)."""
        raise NotImplementedError

    def _forward_head(self, step: HeadStep, group: KVGroup) -> tuple[Tensor, KV | None]:
        """One head forward over the rows of the head's `group`: new context taps, then the draft block.
        Returns (per-depth log-probs `[R, B-1, V]`, `present` in the `past ++ new` layout, or None when
        the head appended to the group's cache itself)."""
        raise NotImplementedError

    def _device_scope(self) -> Any:
        """Context every step runs in (a runtime that must make its device current overrides it)."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ slots
    def release(self, slot: int) -> None:
        """Free `slot` now: its target and head KV rows, its queued taps, a verify waiting for its commit."""
        self.kv.reset(slot)
        if self.head_kv is not None:
            self.head_kv.reset(slot)
        self.queue(slot).clear()  # a last commit leaves taps queued for a draft never made
        self._verified.pop(slot, None)

    def _reset(self) -> None:
        self.release(0)

    def _queue(self, slot: int, taps: Tensor | None, first_position: int) -> None:
        if self.head_kv is not None and taps is not None:
            self.queue(slot).push(taps, first_position)

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, prompt_ids: Tensor, slot: int = 0) -> Tensor:
        """Reset `slot`, run the prompt `[T]` through the target; return the last position's logits `[V]`."""
        ids = torch.as_tensor(prompt_ids).reshape(-1).to(torch.long)
        total = int(ids.numel())
        if total == 0:
            raise ValueError("prompt is empty: at least one token is needed to start decoding")
        if total > self.max_positions:
            raise ValueError(f"prompt of {total} tokens exceeds the context limit of {self.max_positions}")
        self.release(slot)
        return self.extend(slot, ids)

    @torch.no_grad()
    def extend(self, slot: int, ids: Tensor) -> Tensor:
        """Append prompt tokens `ids` to `slot` (prefilled on its own, not yet decoding in a batch): chain
        forwards after its committed rows, in chunks of `max_prefill_rows`; return the last row's logits."""
        ids = torch.as_tensor(ids).reshape(-1).to(torch.long)
        group = self.kv.group(slot)
        if group.size != 1:
            raise RuntimeError(f"slot {slot} decodes in a batch of {group.size}: a prompt is prefilled alone")
        start, total = group.lengths[0], int(ids.numel())
        if total == 0:
            raise ValueError("extend() needs at least one token")
        if start + total > self.max_positions:
            raise ValueError(
                f"prompt of {start + total} tokens exceeds the context limit of {self.max_positions}"
            )
        with self._device_scope():
            ids = ids.to(self.device)
            chunk = self.max_prefill_rows or total
            for first in range(0, total, chunk):
                part = ids[first : first + chunk]
                n = int(part.numel())
                at = start + first
                logits, taps, present = self._forward_target(_chain_step(part, at, self.device), group)
                group.stage(n, present)
                group.commit()
                self._queue(slot, taps, at)
            return logits[0, -1]

    # ------------------------------------------------------------------ one round, batched
    @property
    def causal_head(self) -> bool:
        """Whether the head's in-block mask is causal (then a draft may be cut short: module docstring)."""
        return False

    def block_rows(self, depths: int | None = None) -> int:
        """Rows of the draft block that give depths 1..`depths` (all `block_size` of them when `depths`
        is None or the head is bidirectional)."""
        b = self.block_size
        if depths is None or not self.causal_head:
            return b
        return min(b, max(1, int(depths)) + 1)

    @torch.no_grad()
    def draft_batch(
        self, slots: Sequence[int], anchors: Sequence[int], depths: int | None = None
    ) -> list[Tensor]:
        """ONE head forward for the decoding batch `slots`: per request the block `[anchor, MASK...]` at
        its `past_len`; returns per-depth log-probs `[D, V]` per request (in `slots` order), D = B-1 or,
        for a causal head, `min(B-1, depths)` (module docstring)."""
        if self.head_kv is None:
            raise RuntimeError("this backend has no draft head: only autoregressive decoding is possible")
        slots = list(slots)
        if len(anchors) != len(slots):
            raise ValueError(f"one anchor per slot: {len(slots)} slots, {len(anchors)} anchors")
        anchor_of = dict(zip(slots, (int(a) for a in anchors), strict=True))
        with self._device_scope():
            group = self.head_kv.join(slots)
            rows = group.rows
            contexts = [self.queue(s).peek() for s in rows]
            if any(c is None for c in contexts):
                raise RuntimeError("draft() needs new context rows: call prefill() or commit() first")
            step = self._head_step(
                rows,
                [anchor_of[s] for s in rows],
                contexts,  # type: ignore[arg-type]
                group,
                self.block_rows(depths),
            )
            logprobs, present = self._forward_head(step, group)
            t = int(step.context_taps.shape[1])
            group.stage(t, present)
            group.commit(None if step.dense else [torch.arange(int(n)) for n in step.context_lengths])
            for s in rows:
                self.queue(s).clear()
        return [logprobs[rows.index(s)] for s in slots]

    def _head_step(
        self,
        rows: list[int],
        anchors: list[int],
        contexts: list[tuple[Tensor, Tensor]],
        group: KVGroup,
        b: int,
    ) -> HeadStep:
        """The head forward over `group`'s rows: their queued context, then a draft block of `b` rows."""
        r, dev = len(rows), self.device
        block = torch.full((r, b), self.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = torch.tensor(anchors, dtype=torch.long, device=dev)
        past = torch.tensor([self.kv.length(s) for s in rows], dtype=torch.long, device=dev)
        positions = past.unsqueeze(1) + torch.arange(b, device=dev)
        lengths = torch.tensor([int(c[0].shape[1]) for c in contexts], dtype=torch.int32)
        if r == 1:
            taps, ctx_positions = contexts[0]
        else:
            t, f = int(lengths.max()), int(contexts[0][0].shape[-1])
            taps = contexts[0][0].new_zeros(r, t, f)
            ctx_positions = torch.empty(r, t, dtype=torch.long, device=contexts[0][1].device)
            for i, (c_taps, c_pos) in enumerate(contexts):
                n = int(c_taps.shape[1])
                taps[i, :n] = c_taps[0]
                ctx_positions[i, :n] = c_pos[0]
                ctx_positions[i, n:] = c_pos[0, -1]  # a valid position for the (invisible) padding rows
        return HeadStep(block, positions, taps, ctx_positions, lengths, group.lengths_tensor())

    @torch.no_grad()
    def verify_batch(self, slots: Sequence[int], trees: Sequence[DraftTree]) -> list[Tensor]:
        """ONE target forward over every request's tree (own size, own KV length) under its tree-causal
        mask; returns logits `[N_i, V]` per request (in `slots` order)."""
        slots = list(slots)
        if len(trees) != len(slots):
            raise ValueError(f"one tree per slot: {len(slots)} slots, {len(trees)} trees")
        tree_of = dict(zip(slots, trees, strict=True))
        with self._device_scope():
            group = self.kv.join(slots)
            rows = group.rows
            ordered = [tree_of[s] for s in rows]
            step = _tree_step(ordered, group.lengths_tensor(), self.device)
            logits, taps, present = self._forward_target(step, group)
            group.stage(step.num_rows, present)
        for i, (s, tree) in enumerate(zip(rows, ordered, strict=True)):
            self._verified[s] = None if taps is None else taps[i : i + 1, : tree.num_nodes]
        return [logits[rows.index(s), : tree_of[s].num_nodes] for s in slots]

    @torch.no_grad()
    def commit_batch(self, slots: Sequence[int], accepted: Sequence[Sequence[int]]) -> None:
        """Per request, keep the KV rows of its accepted root path (node ids, root first) after its
        committed rows (only the kept rows move); queue their taps for the head."""
        slots = list(slots)
        if any(s not in self._verified for s in slots):
            raise RuntimeError("commit() without a preceding verify()")
        keep_of = {
            s: torch.as_tensor(list(a), dtype=torch.long).reshape(-1)  # host: the stores check it there
            for s, a in zip(slots, accepted, strict=True)
        }
        with self._device_scope():
            group = self.kv.join(slots)
            past = dict(zip(group.rows, group.lengths, strict=True))
            group.commit([keep_of[s] for s in group.rows])
            for s in group.rows:
                taps = self._verified.pop(s)
                if taps is not None:
                    self._queue(s, taps.index_select(1, keep_of[s].to(taps.device)), past[s])

    # ------------------------------------------ slot 0 alone: conveniences over the protocol (tests, notebooks)
    def draft(self, anchor_token: int, depths: int | None = None) -> Tensor:
        """One head forward on `[anchor, MASK...]` at `past_len`; return log-probs `[D, V]` (`draft_batch`)."""
        return self.draft_batch([0], [anchor_token], depths)[0]

    def verify(self, tree: DraftTree) -> Tensor:
        """One target forward over every tree node under the tree-causal mask; return logits `[N, V]`."""
        return self.verify_batch([0], [tree])[0]

    def commit(self, accepted: list[int]) -> None:
        """Keep the KV rows of the accepted root path (node ids, root first); queue their taps for the head."""
        self.commit_batch([0], [accepted])
