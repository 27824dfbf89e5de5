"""KV stores: where a backend keeps the KV rows of the sequences it decodes, one slot per request.

Every backend runs the same round on its caches (`sequence.SequenceBackend`): a forward appends `n` new
rows after a slot's committed rows (a draft tree, a prompt chunk, or the head's new context rows), the
store *stages* them, and `commit` then keeps either all of them (prefill, head context) or the committed
prefix plus a chosen subset of them (the root path of a verified tree, in that order) and drops the rest.
A forward always starts from the committed rows: rows staged by an earlier forward that was never
committed are discarded, whatever the store. What differs between runtimes is only who holds the memory
and who appends:

* `TensorKVStore`: explicit `[L, 1, Hkv, P, d]` tensors, the graph contract's `past_*` in and `present_*`
  out (ONNX Runtime and the decode graphs run eagerly);
* `HFCacheStore`: a transformers `DynamicCache` that the eager target appends to itself; `HeadCacheStore`:
  the draft head's `HeadCache`, same pattern;
* `BufferKVStore`: two preallocated flat buffers per slot (ping-pong): `past` views the committed rows,
  the forward writes `present` into the other buffer, `commit` swaps them (keep all) or gathers the kept
  rows back with one `index_select(..., out=...)` (TensorRT: no allocation while decoding).

Slots: a store holds `num_slots` independent sequences. The batch-1 backends use slot 0; a batched
backend gives each request its own slot (its own KV length), and `reset(slot)` frees a finished request's
rows at once, so requests can join and leave between rounds (continuous batching).
"""

from __future__ import annotations

import operator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from jetflow_pl.runtime.hf_cache import cache_length, compact_cache, crop_cache, new_cache

KV = tuple[Tensor, Tensor]

__all__ = [
    "KV",
    "BufferKVStore",
    "HFCacheStore",
    "HeadCacheStore",
    "KVStore",
    "TensorKVStore",
]


@runtime_checkable
class KVStore(Protocol):
    """Committed and staged KV rows of `num_slots` sequences (see the module docstring)."""

    num_slots: int

    def length(self, slot: int = 0) -> int:
        """Committed rows of `slot` (the sequence's KV length)."""
        ...

    def staged(self, slot: int = 0) -> int:
        """Rows appended by the last forward and not committed yet (0 when none)."""
        ...

    def reset(self, slot: int = 0) -> None:
        """Drop every row of `slot` (a new sequence, or a finished one freeing its memory)."""
        ...

    def stage(self, n: int, present: KV | None = None, slot: int = 0) -> None:
        """A forward appended `n` rows after the committed ones; `present` is its output where the store
        does not append by itself (`past ++ new` keys and values)."""
        ...

    def commit(self, keep: Tensor | None = None, slot: int = 0) -> None:
        """Keep the committed rows plus staged rows `keep` (ascending indices into them; None = all)."""
        ...


class _Slots:
    """Committed / staged row counts per slot and the checks every store shares."""

    def __init__(self, num_slots: int) -> None:
        num_slots = operator.index(num_slots)
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._length = [0] * num_slots
        self._staged = [0] * num_slots

    def _slot(self, slot: int) -> int:
        slot = operator.index(slot)
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} is outside this store's {self.num_slots} slot(s)")
        return slot

    def length(self, slot: int = 0) -> int:
        return self._length[self._slot(slot)]

    def staged(self, slot: int = 0) -> int:
        return self._staged[self._slot(slot)]

    def _mark_reset(self, slot: int) -> None:
        self._length[slot] = self._staged[slot] = 0

    def _mark_staged(self, slot: int, n: int) -> None:
        if n < 0:
            raise ValueError(f"a forward appends n >= 0 rows, got {n}")
        self._staged[slot] = n

    def _kept(self, slot: int, keep: Tensor | None) -> tuple[int, int, Tensor | None]:
        """(committed rows, rows kept, keep as a long tensor or None = all staged) after checking `keep`."""
        n = self._staged[slot]
        if keep is None:
            return self._length[slot], n, None
        keep = torch.as_tensor(keep).to(torch.long).reshape(-1)
        if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= n):
            raise IndexError(f"commit keeps rows {keep.tolist()} but the last forward staged {n}")
        return self._length[slot], int(keep.numel()), keep

    def _mark_committed(self, slot: int, kept: int) -> None:
        self._length[slot] += kept
        self._staged[slot] = 0


def _gather_rows(x: Tensor, past: int, keep: Tensor, axis: int) -> Tensor:
    """`x[..., :past] ++ x[..., past + keep]` along `axis` (the prefix is not copied by index)."""
    rows = keep.to(x.device) + past
    return torch.cat([x.narrow(axis, 0, past), x.index_select(axis, rows)], dim=axis)


class TensorKVStore(_Slots):
    """KV rows as explicit `[L, 1, Hkv, P, d]` tensors, replaced by each forward's `present` output."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        num_slots: int = 1,
    ) -> None:
        super().__init__(num_slots)
        self._empty = torch.zeros(num_layers, 1, num_kv_heads, 0, head_dim, dtype=dtype, device=device)
        self._kv: list[KV] = [(self._empty, self._empty)] * self.num_slots
        self._present: list[KV | None] = [None] * self.num_slots

    def past(self, slot: int = 0) -> KV:
        """The committed rows, as the graphs' `past_keys` / `past_values` inputs."""
        return self._kv[self._slot(slot)]

    def reset(self, slot: int = 0) -> None:
        slot = self._slot(slot)
        self._mark_reset(slot)
        self._kv[slot] = (self._empty, self._empty)
        self._present[slot] = None

    def stage(self, n: int, present: KV | None = None, slot: int = 0) -> None:
        slot = self._slot(slot)
        if present is None:
            raise ValueError("TensorKVStore.stage needs the forward's present keys and values")
        want = self._length[slot] + n
        if present[0].shape[3] != want or present[1].shape[3] != want:
            raise RuntimeError(f"present holds {present[0].shape[3]} rows, expected past + new = {want}")
        self._mark_staged(slot, n)
        self._present[slot] = present

    def commit(self, keep: Tensor | None = None, slot: int = 0) -> None:
        slot = self._slot(slot)
        present = self._present[slot]
        if present is None:
            raise RuntimeError("commit() without a staged forward")
        past, kept, keep = self._kept(slot, keep)
        if keep is None:
            self._kv[slot] = present
        else:
            self._kv[slot] = (
                _gather_rows(present[0], past, keep, 3),
                _gather_rows(present[1], past, keep, 3),
            )
        self._present[slot] = None
        self._mark_committed(slot, kept)


class HFCacheStore(_Slots):
    """A transformers cache per slot; the target appends to it inside its forward (`jetflow_pl.target`)."""

    def __init__(self, config: Any, num_slots: int = 1) -> None:
        super().__init__(num_slots)
        self._config = config
        self._caches = [new_cache(config) for _ in range(self.num_slots)]

    def cache(self, slot: int = 0):
        """The slot's cache for the next forward: its committed rows (uncommitted staged rows dropped)."""
        slot = self._slot(slot)
        if self._staged[slot]:
            crop_cache(self._caches[slot], self._length[slot])
            self._staged[slot] = 0
        return self._caches[slot]

    def reset(self, slot: int = 0) -> None:
        slot = self._slot(slot)
        self._mark_reset(slot)
        self._caches[slot] = new_cache(self._config)

    def stage(self, n: int, present: KV | None = None, slot: int = 0) -> None:
        slot = self._slot(slot)
        have = cache_length(self._caches[slot])
        if have != self._length[slot] + n:
            raise RuntimeError(f"the cache holds {have} rows, expected {self._length[slot]} + {n} new")
        self._mark_staged(slot, n)

    def commit(self, keep: Tensor | None = None, slot: int = 0) -> None:
        slot = self._slot(slot)
        past, kept, keep = self._kept(slot, keep)
        if keep is not None:
            compact_cache(self._caches[slot], past, keep)  # checks the resulting length itself
        self._mark_committed(slot, kept)


class HeadCacheStore(_Slots):
    """The draft head's context K/V (`jetflow_pl.head.HeadCache`) per slot; the head appends to it."""

    def __init__(self, head: Any, num_slots: int = 1) -> None:
        super().__init__(num_slots)
        self._head = head
        self._caches = [head.new_cache() for _ in range(self.num_slots)]

    def cache(self, slot: int = 0):
        """The slot's `HeadCache` for the next forward (uncommitted staged rows dropped)."""
        slot = self._slot(slot)
        if self._staged[slot]:
            self._caches[slot].crop(self._length[slot])
            self._staged[slot] = 0
        return self._caches[slot]

    def reset(self, slot: int = 0) -> None:
        slot = self._slot(slot)
        self._mark_reset(slot)
        self._caches[slot] = self._head.new_cache()

    def stage(self, n: int, present: KV | None = None, slot: int = 0) -> None:
        slot = self._slot(slot)
        have = self._caches[slot].length
        if have != self._length[slot] + n:
            raise RuntimeError(f"the head cache holds {have} rows, expected {self._length[slot]} + {n} new")
        self._mark_staged(slot, n)

    def commit(self, keep: Tensor | None = None, slot: int = 0) -> None:
        slot = self._slot(slot)
        past, kept, keep = self._kept(slot, keep)
        if keep is not None:
            cache = self._caches[slot]
            for layer in range(cache.num_layers):
                k, v = cache.get(layer)
                if k is not None:
                    cache.keys[layer] = _gather_rows(k, past, keep, 2)
                    cache.values[layer] = _gather_rows(v, past, keep, 2)
        self._mark_committed(slot, kept)


def flat_view(buffer: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A dense tensor of `shape` over the start of a flat preallocated `buffer` (no copy, no allocation).

    Always the start: every view is then the start of an allocation (CUDA allocations are 256-byte
    aligned), which TensorRT's kernels expect of a bound tensor; a view into the middle need not be.
    """
    numel = 1
    for s in shape:
        numel *= s
    if numel > buffer.numel():
        raise RuntimeError(f"buffer of {buffer.numel()} elements is too small for {shape}")
    return buffer[:numel].view(shape)


class BufferKVStore(_Slots):
    """Preallocated ping-pong buffers per slot, `capacity` rows each: no allocation while decoding.

    The graph contract takes the cache as `past` `[L, 1, Hkv, P, d]` and returns `present`
    `[L, 1, Hkv, P + n, d]`; `past()` views the committed buffer and `present(n)` the other one, which the
    runtime binds as the forward's output. Because `P` is not the outermost axis, a cache of another
    length has another memory layout, so keeping a subset gathers the whole cache once per round (as the
    graph's own concat does); an in-place append would need a contract with fixed-capacity caches
    written at offset `P`, which the exported graphs do not have.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_slots: int = 1,
    ) -> None:
        super().__init__(num_slots)
        self.capacity = operator.index(capacity)
        self._lead = (int(num_layers), 1, int(num_kv_heads))
        self._d = int(head_dim)
        numel = int(num_layers) * int(num_kv_heads) * self.capacity * self._d
        # [slot][buffer][keys/values]: buffer 0 holds the committed rows, buffer 1 receives `present`
        self._bufs = [
            [[torch.empty(numel, dtype=dtype, device=device) for _ in range(2)] for _ in range(2)]
            for _ in range(self.num_slots)
        ]
        self._rows = torch.arange(self.capacity, dtype=torch.int64, device=device)

    def _views(self, slot: int, buffer: int, rows: int) -> KV:
        shape = (*self._lead, rows, self._d)
        keys, values = self._bufs[slot][buffer]
        return flat_view(keys, shape), flat_view(values, shape)

    def past(self, slot: int = 0) -> KV:
        """Views of the committed rows (bind as `past_keys` / `past_values`)."""
        slot = self._slot(slot)
        return self._views(slot, 0, self._length[slot])

    def present(self, n: int, slot: int = 0) -> KV:
        """Views for the forward's `present_*` output: committed + `n` rows, in the other buffer."""
        slot = self._slot(slot)
        rows = self._length[slot] + n
        if rows > self.capacity:
            raise ValueError(f"{rows} KV rows exceed the preallocated capacity of {self.capacity}")
        return self._views(slot, 1, rows)

    def reset(self, slot: int = 0) -> None:
        self._mark_reset(self._slot(slot))

    def stage(self, n: int, present: KV | None = None, slot: int = 0) -> None:
        slot = self._slot(slot)
        if present is not None and present[0].data_ptr() != self._bufs[slot][1][0].data_ptr():
            raise RuntimeError("present was not written into this store's receiving buffer (bind present(n))")
        self._mark_staged(slot, n)

    def commit(self, keep: Tensor | None = None, slot: int = 0) -> None:
        slot = self._slot(slot)
        past, kept, keep = self._kept(slot, keep)
        if keep is None:
            self._bufs[slot].reverse()  # the present becomes the committed cache: swap, no copy
        else:
            rows = torch.cat([self._rows[:past], keep.to(self._rows.device) + past])
            present = self._views(slot, 1, past + self._staged[slot])
            compacted = self._views(slot, 0, past + kept)
            for src, dst in zip(present, compacted, strict=True):
                torch.index_select(src, 3, rows, out=dst)
        self._mark_committed(slot, kept)
