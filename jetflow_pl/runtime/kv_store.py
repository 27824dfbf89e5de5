"""KV stores: where a backend keeps the KV rows of the sequences it decodes, one slot per request.

Every backend runs the same round on its caches (`sequence.SequenceBackend`): a forward appends `n` new
rows after a sequence's committed rows (a draft tree, a prompt chunk, or the head's new context rows),
the store *stages* them, and `commit` then keeps either all of them (prefill, head context) or the
committed prefix plus a chosen subset of them (the root path of a verified tree, in that order) and drops
the rest. A forward always starts from the committed rows: rows staged by an earlier forward that was
never committed are discarded, whatever the store.

**Groups (batches).** A forward runs over the rows of one `KVGroup`: the KV of `size` sequences as one
padded batch tensor. Row `r` holds slot `rows[r]`; its committed rows sit at positions
`[0, lengths[r])` of a padded length `P = max(lengths)` (the rest of a shorter row is padding, never
visible: the forward is told `lengths`, TensorRT-LLM's per-request KV lengths), and a forward appends
`staged` rows at `[P, P + staged)` to every row. `commit(keeps)` moves each row's kept rows down to
follow its committed prefix, inside the forward's output (only the kept rows move), so rows of different
lengths and acceptances stay one tensor that the next forward reads as it is.

A slot starts *alone* (its own one-row group: a prompt is prefilled on its own, in chunks) and `join`
moves alone slots into the store's decode batch, the group every batched round runs over. `reset(slot)`
frees a slot at once: it leaves its group, where its row turns *vacant* (`KVGroup.vacate`) until the
next `join`, which hands the row to a request that joins (its own rows written in place) or drops it;
so requests join and leave between rounds (continuous batching) without re-laying out the whole batch
each time one does. A batch whose last request leaves frees its tensors at once. The per-slot calls
(`length(slot)`, `stage(n, present, slot)`, `commit(keep, slot)`) work on a slot whose group is that
slot alone (the batch-1 backends use slot 0).

What differs between runtimes is only who holds the memory and who appends:

* `TensorKVStore`: explicit `[L, R, Hkv, P, d]` tensors, the graph contract's `past_*` in and `present_*`
  out (ONNX Runtime and the decode graphs run eagerly);
* `HFCacheStore`: a transformers `DynamicCache` of batch `R` that the eager target appends to itself;
  `HeadCacheStore`: the draft head's `HeadCache`, same pattern;
* `BufferKVStore`: two preallocated flat buffers per slot (ping-pong): `past` views the committed rows,
  the forward writes `present` into the other buffer, `commit` swaps them (keep all) or gathers the kept
  rows back with one `index_select(..., out=...)` (TensorRT: no allocation while decoding; one request per
  group, the engines' profile is batch 1).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from jetflow_pl.runtime.hf_cache import (
    cache_from_layer_tensors,
    cache_length,
    crop_cache,
    layer_tensors,
    new_cache,
    set_layer_tensors,
)

KV = tuple[Tensor, Tensor]

__all__ = [
    "KV",
    "VACANT",
    "BufferKVStore",
    "HFCacheStore",
    "HeadCacheStore",
    "KVGroup",
    "KVStore",
    "TensorKVStore",
]

Keeps = Sequence[Tensor | None] | None
#: `KVGroup.rows` entry of a row whose request left (`KVGroup.vacate`): kept until the next join
VACANT = -1


@runtime_checkable
class KVStore(Protocol):
    """Committed and staged KV rows of `num_slots` sequences (see the module docstring)."""

    num_slots: int

    def group(self, slot: int) -> KVGroup:
        """The group holding `slot` (its own one-row group until it joins the batch)."""
        ...

    def join(self, slots: Sequence[int]) -> KVGroup:
        """The group whose rows are exactly `slots`, moving alone slots into the decode batch."""
        ...

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
        """A forward appended `n` rows after the committed ones of an alone `slot`; `present` is its output
        where the store does not append by itself (`past ++ new` keys and values)."""
        ...

    def commit(self, keep: Tensor | None = None, slot: int = 0) -> None:
        """Keep the committed rows plus staged rows `keep` (ascending indices into them; None = all)."""
        ...


# --------------------------------------------------------------------------------------------------
# row bookkeeping shared by every memory layout
# --------------------------------------------------------------------------------------------------


def _is_prefix(keep: Tensor) -> bool:
    """`keep` is `0, 1, ..., m-1` (a chain's root path, an AR step's root)."""
    return bool((keep == torch.arange(keep.numel())).all())


class KVGroup:
    """The rows of one padded batch (see the module docstring); subclasses hold the tensors.

    `rows[r]` is the slot of row `r`, `lengths[r]` its committed rows, `padded` the padded length `P` of
    the committed tensors: max(lengths) plus `slack`, rows of padding past the longest row that a layout
    may keep to save a copy (`_width_after_commit`; 0 unless it does), `staged` the rows the last forward
    appended after `P` to every row (0: none, or already committed).
    """

    batch_axis = 0
    pos_axis = 2

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.lengths: list[int] = []
        self.staged = 0
        self.slack = 0

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def padded(self) -> int:
        return max(self.lengths, default=0) + self.slack

    def row(self, slot: int) -> int:
        try:
            return self.rows.index(slot)
        except ValueError:
            raise KeyError(f"slot {slot} is not in this group (rows {self.rows})") from None

    def lengths_tensor(self, device: torch.device | str = "cpu") -> Tensor:
        """int32 `[R]`: the committed length of every row (the forwards' `past_lengths`)."""
        return torch.tensor(self.lengths, dtype=torch.int32, device=device)

    # ---- what a layout implements -----------------------------------------------------------------
    def _source(self) -> list[Tensor]:
        """The tensors holding committed (padded to P) + staged rows along `pos_axis`."""
        raise NotImplementedError

    def _replace(self, tensors: list[Tensor]) -> None:
        """Make `tensors` (the same parts, re-laid out) the committed content; drop any staged output."""
        raise NotImplementedError

    def _committed(self) -> list[Tensor]:
        """The committed tensors (padded length P along `pos_axis`)."""
        raise NotImplementedError

    def _adopt(self, other: KVGroup) -> None:
        """Take `other`'s tensors as this (empty) group's own."""
        raise NotImplementedError

    def _width_after_commit(self, full: int, longest: int, staged: int) -> int:  # noqa: ARG002
        """The padded length the committed tensors keep after a commit: `longest` (the new longest row:
        the forward's output `full` rows wide is cut to it) unless a layout keeps padding (TensorKVGroup)."""
        return longest

    def _keeps_slack(self) -> bool:
        """Whether the forwards over this layout allow padding past the longest row (`slack`)."""
        return False

    def _cut(self, t: Tensor, width: int) -> Tensor:
        """`t` cut to `width` rows along `pos_axis` (a view; a layout may copy it into place)."""
        return t.narrow(self.pos_axis, 0, width)

    def _check_stage(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"a forward appends n >= 0 rows, got {n}")

    def stage(self, n: int, present: KV | None = None) -> None:
        """A forward appended `n` rows after `P` to every row (`present`: its output, where needed)."""
        raise NotImplementedError

    # ---- the shared operations --------------------------------------------------------------------
    def _keeps(self, keeps: Keeps) -> list[Tensor | None]:
        if keeps is None:
            return [None] * self.size
        if len(keeps) != self.size:
            raise ValueError(f"commit needs one keep per row ({self.size}), got {len(keeps)}")
        out: list[Tensor | None] = []
        n = self.staged
        for keep in keeps:
            if keep is not None:
                keep = torch.as_tensor(keep).to(torch.long).reshape(-1)
                if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= n):
                    raise IndexError(f"commit keeps rows {keep.tolist()} but the last forward staged {n}")
            out.append(keep)
        return out

    def _has_staged(self) -> bool:
        return True

    def commit(self, keeps: Keeps = None) -> None:
        """Keep, per row, the committed prefix plus staged rows `keeps[r]` (None: all of them), in place.

        Row `r`'s kept rows move from `[P + keep]` down to `[lengths[r], lengths[r] + m)` inside the last
        forward's output (one indexed copy over the whole batch, of the kept rows only: a few per request),
        and the result is that tensor cut to the new longest row (a view). Rows already in place (a full
        row keeping a prefix of its new rows: every AR step of the longest requests, every prefill) move
        nothing. Re-gathering the whole padded batch instead, as this did before, copied every committed
        row of every request each round: 27% of a 16-request AR round on ONNX Runtime (SmolLM2, 66 of
        241 ms). What is left in `[lengths[r], P)` of a shorter row is rows its own forwards wrote and
        dropped: finite, and never visible (the forwards mask every row past `lengths[r]`)."""
        if not self._has_staged():
            raise RuntimeError("commit() without a staged forward")
        keeps = self._keeps(keeps)
        p, n = self.padded, self.staged
        new: list[int] = []
        moves: list[tuple[int, int, Tensor]] = []  # (row, first destination, source positions)
        for r, (ln, keep) in enumerate(zip(self.lengths, keeps, strict=True)):
            m = n if keep is None else int(keep.numel())
            new.append(ln + m)
            if m and not (ln == p and (keep is None or _is_prefix(keep))):
                moves.append((r, ln, p + (torch.arange(n) if keep is None else keep)))
        source = self._source()
        if moves:
            rows = torch.cat([torch.full((int(s.numel()),), r, dtype=torch.long) for r, _, s in moves])
            dst = torch.cat([torch.arange(ln, ln + int(s.numel())) for _, ln, s in moves])
            src = torch.cat([s for _, _, s in moves])
            for t in source:
                at_src: list[Any] = [slice(None)] * t.dim()
                at_dst: list[Any] = [slice(None)] * t.dim()
                at_src[self.batch_axis] = at_dst[self.batch_axis] = rows.to(t.device)
                at_src[self.pos_axis], at_dst[self.pos_axis] = src.to(t.device), dst.to(t.device)
                t[tuple(at_dst)] = t[tuple(at_src)]  # the right side is a copy: overlapping moves are safe
        longest = max(new, default=0)
        width = max(longest, self._width_after_commit(p + n, longest, n))
        self._replace([t if t.shape[self.pos_axis] == width else self._cut(t, width) for t in source])
        self.lengths = new
        self.slack = width - longest
        self.staged = 0

    @property
    def live(self) -> int:
        """Rows held by a slot (`size` less the vacant rows, see `vacate`)."""
        return sum(1 for s in self.rows if s != VACANT)

    def merge(self, *others: KVGroup) -> None:
        """Append `others`' rows (committed, nothing staged) to this group in one copy; each is left empty.

        The merged tensors are allocated once at the longest padded length and every group's rows copied
        in (padding zeroed, so never-visible rows stay finite): `B` requests joining at once cost one
        copy of the batch, not `B` growing ones (measured, ONNX Runtime, 16 requests, a sustained AR pass:
        joins one by one took 28 ms each, and with the leaves 11% of the pass)."""
        if self.staged or any(o.staged for o in others):
            raise RuntimeError("a group with a staged forward cannot be merged: commit it first")
        others = [o for o in others if o.size]
        if not others:
            return
        if self.size == 0:
            first, *others = others
            self._adopt(first)
            self.rows, self.lengths, self.slack = list(first.rows), list(first.lengths), first.slack
            first._leave_all()
            if not others:
                return
        groups = [self, *others]
        width = max(g.padded for g in groups)
        parts = [g._committed() for g in groups]
        ref = next((p for p in parts if p), None)
        if ref is not None:  # a head cache that has read nothing yet holds no tensors at all
            merged = []
            for i, like in enumerate(ref):
                shape = list(like.shape)
                shape[self.batch_axis], shape[self.pos_axis] = sum(g.size for g in groups), width
                out = like.new_zeros(shape)
                at = 0
                for g, part in zip(groups, parts, strict=True):
                    if part:
                        src = part[i]
                        out.narrow(self.batch_axis, at, g.size).narrow(
                            self.pos_axis, 0, src.shape[self.pos_axis]
                        ).copy_(src)
                    at += g.size
                merged.append(out)
            self._replace(merged)
        for o in others:
            self.rows += o.rows
            self.lengths += o.lengths
            o._leave_all()
        self.slack = width - max(self.lengths, default=0)

    def vacate(self, slot: int) -> None:
        """`slot` leaves the group: its row turns vacant (`VACANT` in `rows`, length 0) and stays in the
        tensors until the next `admit`, which hands it to a request that joins (written in place: the
        joiner's rows only) or drops it. A staged forward is discarded, as any change of rows does.
        Compacting at once would copy every other row: with speculation requests finish in different
        rounds, and on ONNX Runtime at 16 requests a leave then a join copied the batch twice, ~+100 ms
        on a ~120 ms round, in a quarter of the rounds. A group left with no live row frees its tensors."""
        r = self.row(slot)
        if self.staged:
            self._replace(self._committed())
        width = self.padded
        self.rows[r], self.lengths[r], self.staged = VACANT, 0, 0
        if self.live == 0:
            self._leave_all()
            return
        self.slack = width - max(self.lengths)

    def admit(self, others: Sequence[KVGroup]) -> None:
        """Make this group its live rows plus every row of `others` (committed groups, each left empty),
        with no vacant row: a one-row joiner whose rows fit the padded length takes over a vacant row in
        place (only its own rows are written; what is left of the old request past its length is never
        visible), the vacant rows left are dropped with one gather of the live rows, and the joiners left
        are appended in one copy (`merge`)."""
        if self.staged or any(o.staged for o in others):
            raise RuntimeError("a group with a staged forward cannot be merged: commit it first")
        vacant = [r for r, s in enumerate(self.rows) if s == VACANT]
        rest = [o for o in others if o.size]
        if vacant and rest:
            mine = self._committed()
            width = self.padded  # the tensors' length: joiners fill rows inside it
            left = []
            for o in rest:
                theirs = o._committed() if o.size == 1 else []
                n = o.lengths[0] if o.size == 1 else 0
                if not (vacant and mine and len(theirs) == len(mine) and n <= width):
                    left.append(o)
                    continue
                r = vacant.pop(0)
                for a, b in zip(mine, theirs, strict=True):
                    a.narrow(self.batch_axis, r, 1).narrow(self.pos_axis, 0, n).copy_(
                        b.narrow(self.pos_axis, 0, n)
                    )
                self.rows[r], self.lengths[r] = o.rows[0], n
                o._leave_all()
            self._replace(mine)
            self.slack = width - max(self.lengths)
            rest = left
        if vacant:
            self._drop_rows(vacant)
        self.merge(*rest)
        if self.slack and not self._keeps_slack():  # the longest row left: a layout without slack cuts
            longest = max(self.lengths)
            self._replace([self._cut(t, longest) for t in self._committed()])
            self.slack = 0

    def _drop_rows(self, rows: Sequence[int]) -> None:
        """Remove `rows` from the tensors in one gather of the others, cut to their longest (no slack)."""
        dropped = set(rows)
        keep = [i for i in range(self.size) if i not in dropped]
        lengths = [self.lengths[i] for i in keep]
        slots = [self.rows[i] for i in keep]
        if not keep:
            self._clear()
        else:
            p = max(lengths)
            idx = torch.tensor(keep, dtype=torch.long)
            self._replace(
                [
                    t.narrow(self.pos_axis, 0, p).index_select(self.batch_axis, idx.to(t.device))
                    for t in self._committed()
                ]
            )
        self.rows, self.lengths, self.staged, self.slack = slots, lengths, 0, 0

    def _leave_all(self) -> None:
        """No rows and no tensors: every row moved to another group (`merge`, `admit`) or left."""
        self.rows, self.lengths, self.slack = [], [], 0
        self._clear()

    def _clear(self) -> None:
        """Drop every tensor (the group has no rows)."""
        raise NotImplementedError


class _Store:
    """Slots -> groups: alone one-row groups and the decode batch (see the module docstring)."""

    def __init__(self, num_slots: int) -> None:
        num_slots = operator.index(num_slots)
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._group_of: list[KVGroup | None] = [None] * num_slots
        self.batch = self._new_group()

    def _new_group(self) -> KVGroup:
        raise NotImplementedError

    def _slot(self, slot: int) -> int:
        slot = operator.index(slot)
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} is outside this store's {self.num_slots} slot(s)")
        return slot

    def group(self, slot: int) -> KVGroup:
        slot = self._slot(slot)
        g = self._group_of[slot]
        if g is None:
            g = self._new_group()
            g.rows, g.lengths = [slot], [0]
            self._group_of[slot] = g
        return g

    def join(self, slots: Sequence[int]) -> KVGroup:
        slots = [self._slot(s) for s in slots]
        if not slots or len(set(slots)) != len(slots):
            raise ValueError(f"a batch needs distinct slots, got {slots}")
        first = self.group(slots[0])
        if set(first.rows) == set(slots):
            return first
        joining = []
        for s in slots:
            g = self.group(s)
            if g is self.batch:
                continue
            if g.size != 1:
                raise ValueError(f"slot {s} cannot join the batch: it is part of another group")
            joining.append(g)
        self.batch.admit(joining)  # vacant rows taken over or dropped, the rest appended in one copy
        for s in slots:
            self._group_of[s] = self.batch
        if set(self.batch.rows) != set(slots):
            raise ValueError(
                f"slots {sorted(slots)} are not the decoding batch {sorted(self.batch.rows)}: "
                "every batched round runs over the whole batch (reset finished slots first)"
            )
        return self.batch

    def reset(self, slot: int = 0) -> None:
        slot = self._slot(slot)
        g = self._group_of[slot]
        if g is not None and g is self.batch:
            g.vacate(slot)  # its row is reused by the next request to join, or dropped at the next join
        self._group_of[slot] = None

    def _alone(self, slot: int) -> KVGroup:
        g = self.group(slot)
        if g.size != 1:
            raise RuntimeError(f"slot {slot} is one row of a batch of {g.size}: stage and commit the batch")
        return g

    def length(self, slot: int = 0) -> int:
        g = self.group(slot)
        return g.lengths[g.row(slot)]

    def staged(self, slot: int = 0) -> int:
        return self.group(slot).staged

    def stage(self, n: int, present: KV | None = None, slot: int = 0) -> None:
        self._alone(slot).stage(n, present)

    def commit(self, keep: Tensor | None = None, slot: int = 0) -> None:
        self._alone(slot).commit(None if keep is None else [keep])


# --------------------------------------------------------------------------------------------------
# explicit tensors (the graph contract)
# --------------------------------------------------------------------------------------------------


class TensorKVGroup(KVGroup):
    """Rows as explicit `[L, R, Hkv, P, d]` tensors, replaced by each forward's `present` output.

    `keep_slack` (graphs told each row's length, `past_lengths`: the batched graphs) keeps the output of a
    tree round whole instead of cutting it to the longest row. Cut, it is a strided view that the next
    forward's runtime copies into a dense input, the whole cache once more: measured on ONNX Runtime
    (SmolLM2, 16 requests, 2 cores) an AR round right after a budget-1 round took 257 ms against 181 ms
    after an AR round at KV 256 (190 against 138 at 128), a cost of the tree round that the next round
    paid. The rows past the longest are padding like any row's past its length. They cost each forward
    about their share of the cache, and they grow by at most the staged rows per round, so they are cut
    (once, copied dense here) when slack^2 > 2 x longest x staged: a dense copy costs about one pass over
    the cache (the measurement above: 76 ms against ~0.34 ms per cached row), and with growth g per round
    the slack's cost plus the copy's, per round, is least at a limit of sqrt(2 x cache x g).

    A group of one row keeps none: there the copy is cheap next to what padding costs the forwards
    (measured, same setup, 8 requests x 48 tokens, slack on/off side by side, two passes each: one request
    at budget 16 ran 5-9% slower with slack, at budget 4 the same within noise; 4 requests at budget 8
    ran 6-9% faster with it, 8 requests at budget 2 4-6% faster).
    """

    batch_axis = 1
    pos_axis = 3

    def __init__(self, empty: Tensor, keep_slack: bool = False) -> None:
        super().__init__()
        self._empty = empty  # [L, 1, Hkv, 0, d]
        self.keep_slack = bool(keep_slack)
        self._kv: KV | None = None
        self._present: KV | None = None

    def _width_after_commit(self, full: int, longest: int, staged: int) -> int:
        if self.keep_slack and self.size > 1 and (full - longest) ** 2 <= 2 * longest * staged:
            return full
        return longest

    def _keeps_slack(self) -> bool:
        return self.keep_slack

    def _cut(self, t: Tensor, width: int) -> Tensor:
        cut = t.narrow(self.pos_axis, 0, width)
        return cut.contiguous() if self.keep_slack else cut

    def past(self) -> KV:
        """The committed rows of every row, `[L, R, Hkv, P, d]` (the graphs' `past_keys`/`past_values`)."""
        if self._kv is None:
            shape = list(self._empty.shape)
            shape[1] = self.size
            empty = self._empty.new_zeros(shape)
            return empty, empty
        return self._kv

    def stage(self, n: int, present: KV | None = None) -> None:
        self._check_stage(n)
        if present is None:
            raise ValueError("TensorKVStore.stage needs the forward's present keys and values")
        want = self.padded + n
        for t in present:
            if t.shape[1] != self.size:
                raise RuntimeError(f"present holds {t.shape[1]} batch rows, the group has {self.size}")
            if t.shape[3] != want:
                raise RuntimeError(f"present holds {t.shape[3]} rows, expected past + new = {want}")
        self.staged, self._present = n, present

    def _has_staged(self) -> bool:
        return self._present is not None

    def _source(self) -> list[Tensor]:
        assert self._present is not None
        return list(self._present)

    def _committed(self) -> list[Tensor]:
        return list(self.past())

    def _replace(self, tensors: list[Tensor]) -> None:
        self._kv = (tensors[0], tensors[1])
        self._present = None

    def _adopt(self, other: KVGroup) -> None:
        assert isinstance(other, TensorKVGroup)
        self._kv = other._kv

    def _clear(self) -> None:
        self._kv = self._present = None


class TensorKVStore(_Store):
    """KV rows as explicit `[L, R, Hkv, P, d]` tensors per group (the graph contract's caches)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        num_slots: int = 1,
        keep_slack: bool = False,
    ) -> None:
        """`keep_slack`: the forwards take each row's length (`past_lengths`), so padding past the longest
        row is allowed and a tree round's output is kept whole (`TensorKVGroup`)."""
        self._empty = torch.zeros(num_layers, 1, num_kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.keep_slack = bool(keep_slack)
        super().__init__(num_slots)

    def _new_group(self) -> TensorKVGroup:
        return TensorKVGroup(self._empty, self.keep_slack)

    def past(self, slot: int = 0) -> KV:
        """The committed rows of an alone `slot`, `[L, 1, Hkv, P, d]`."""
        return self._alone(slot).past()


# --------------------------------------------------------------------------------------------------
# caches the models append to themselves (eager torch)
# --------------------------------------------------------------------------------------------------


class HFCacheGroup(KVGroup):
    """A transformers cache of batch R; the target appends to it inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        self._cache = new_cache()

    def cache(self):
        """The cache for the next forward: the committed rows (uncommitted staged rows dropped)."""
        if self.staged:
            crop_cache(self._cache, self.padded)
            self.staged = 0
        return self._cache

    def stage(self, n: int, present: KV | None = None) -> None:
        self._check_stage(n)
        have = cache_length(self._cache)
        if have != self.padded + n:
            raise RuntimeError(f"the cache holds {have} rows, expected {self.padded} + {n} new")
        self.staged = n

    def _source(self) -> list[Tensor]:
        return layer_tensors(self._cache)

    def _committed(self) -> list[Tensor]:
        return layer_tensors(self.cache())

    def _replace(self, tensors: list[Tensor]) -> None:
        if layer_tensors(self._cache) or not tensors:
            set_layer_tensors(self._cache, tensors)
        else:  # the cache holds nothing yet: build it from the tensors
            self._cache = cache_from_layer_tensors(tensors)

    def _adopt(self, other: KVGroup) -> None:
        assert isinstance(other, HFCacheGroup)
        self._cache = other._cache

    def _clear(self) -> None:
        self._cache = new_cache()


class HFCacheStore(_Store):
    """A transformers cache per group; the target appends to it inside its forward (`jetflow_pl.target`)."""

    def __init__(self, num_slots: int = 1) -> None:
        super().__init__(num_slots)

    def _new_group(self) -> HFCacheGroup:
        return HFCacheGroup()

    def cache(self, slot: int = 0):
        """The cache of an alone `slot` for the next forward (uncommitted staged rows dropped)."""
        g = self._alone(slot)
        assert isinstance(g, HFCacheGroup)
        return g.cache()


class HeadCacheGroup(KVGroup):
    """The draft head's context K/V (`jetflow_pl.head.HeadCache`, layers `[R, Hkv, P, d]`); the head
    appends to it."""

    def __init__(self, head: Any) -> None:
        super().__init__()
        self._head = head
        self._cache = head.new_cache()

    def cache(self):
        """The `HeadCache` for the next forward (uncommitted staged rows dropped)."""
        if self.staged:
            self._cache.crop(self.padded)
            self.staged = 0
        return self._cache

    def stage(self, n: int, present: KV | None = None) -> None:
        self._check_stage(n)
        have = self._cache.length
        if have != self.padded + n:
            raise RuntimeError(f"the head cache holds {have} rows, expected {self.padded} + {n} new")
        self.staged = n

    def _parts(self, cache) -> list[Tensor]:
        out: list[Tensor] = []
        for layer in range(cache.num_layers):
            k, v = cache.get(layer)
            if k is not None:
                out += [k, v]
        return out

    def _source(self) -> list[Tensor]:
        return self._parts(self._cache)

    def _committed(self) -> list[Tensor]:
        return self._parts(self.cache())

    def _replace(self, tensors: list[Tensor]) -> None:
        cache = self._cache
        it = iter(tensors)
        every = len(tensors) == 2 * cache.num_layers  # (a cache that held nothing gets every layer)
        for layer in range(cache.num_layers):
            if every or cache.keys[layer] is not None:
                cache.keys[layer], cache.values[layer] = next(it), next(it)

    def _adopt(self, other: KVGroup) -> None:
        assert isinstance(other, HeadCacheGroup)
        self._cache = other._cache

    def _clear(self) -> None:
        self._cache = self._head.new_cache()


class HeadCacheStore(_Store):
    """The draft head's context K/V (`jetflow_pl.head.HeadCache`) per group; the head appends to it."""

    def __init__(self, head: Any, num_slots: int = 1) -> None:
        self._head = head
        super().__init__(num_slots)

    def _new_group(self) -> HeadCacheGroup:
        return HeadCacheGroup(self._head)

    def cache(self, slot: int = 0):
        """The `HeadCache` of an alone `slot` for the next forward (uncommitted staged rows dropped)."""
        g = self._alone(slot)
        assert isinstance(g, HeadCacheGroup)
        return g.cache()


# --------------------------------------------------------------------------------------------------
# preallocated buffers (TensorRT)
# --------------------------------------------------------------------------------------------------


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


class BufferKVGroup(KVGroup):
    """One slot's ping-pong buffers (`BufferKVStore`): a group of exactly one row."""

    batch_axis = 1
    pos_axis = 3

    def __init__(self, store: BufferKVStore, slot: int) -> None:
        super().__init__()
        self._store = store
        self._slot = slot
        self.rows, self.lengths = [slot], [0]

    def past(self) -> KV:
        """Views of the committed rows (bind as `past_keys` / `past_values`)."""
        return self._store._views(self._slot, 0, self.lengths[0])

    def present(self, n: int) -> KV:
        """Views for the forward's `present_*` output: committed + `n` rows, in the other buffer."""
        rows = self.lengths[0] + n
        if rows > self._store.capacity:
            raise ValueError(f"{rows} KV rows exceed the preallocated capacity of {self._store.capacity}")
        return self._store._views(self._slot, 1, rows)

    def stage(self, n: int, present: KV | None = None) -> None:
        self._check_stage(n)
        if present is not None and present[0].data_ptr() != self._store._bufs[self._slot][1][0].data_ptr():
            raise RuntimeError("present was not written into this store's receiving buffer (bind present(n))")
        self.staged = n

    def commit(self, keeps: Keeps = None) -> None:
        (keep,) = self._keeps(keeps)
        past, staged = self.lengths[0], self.staged
        bufs = self._store._bufs[self._slot]
        if keep is None:
            bufs.reverse()  # the present becomes the committed cache: swap, no copy
            kept = staged
        else:
            kept = int(keep.numel())
            rows = torch.cat([self._store._rows[:past], keep.to(self._store._rows.device) + past])
            present = self._store._views(self._slot, 1, past + staged)
            compacted = self._store._views(self._slot, 0, past + kept)
            for src, dst in zip(present, compacted, strict=True):
                torch.index_select(src, 3, rows, out=dst)
        self.lengths = [past + kept]
        self.staged = 0

    def merge(self, other: KVGroup) -> None:
        raise ValueError(
            "the TensorRT backend's buffers hold one request per forward (its profile is batch 1)"
        )

    def drop(self, slot: int) -> None:
        self.row(slot)
        self.lengths, self.staged = [0], 0


class BufferKVStore(_Store):
    """Preallocated ping-pong buffers per slot, `capacity` rows each: no allocation while decoding.

    The graph contract takes the cache as `past` `[L, 1, Hkv, P, d]` and returns `present`
    `[L, 1, Hkv, P + n, d]`; `past()` views the committed buffer and `present(n)` the other one, which the
    runtime binds as the forward's output. Because `P` is not the outermost axis, a cache of another
    length has another memory layout, so keeping a subset gathers the whole cache once per round (as the
    graph's own concat does); an in-place append would need a contract with fixed-capacity caches
    written at offset `P`, which the exported graphs do not have. Each slot is its own group: the slots
    cannot join one batch.
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
        self.capacity = operator.index(capacity)
        self._lead = (int(num_layers), 1, int(num_kv_heads))
        self._d = int(head_dim)
        numel = int(num_layers) * int(num_kv_heads) * self.capacity * self._d
        # [slot][buffer][keys/values]: buffer 0 holds the committed rows, buffer 1 receives `present`
        self._bufs = [
            [[torch.empty(numel, dtype=dtype, device=device) for _ in range(2)] for _ in range(2)]
            for _ in range(num_slots)
        ]
        self._rows = torch.arange(self.capacity, dtype=torch.int64, device=device)
        super().__init__(num_slots)

    def _new_group(self) -> KVGroup:
        return KVGroup()  # the (always empty) decode batch: slots never join it

    def join(self, slots: Sequence[int]) -> KVGroup:
        if len(slots) != 1:
            raise ValueError(
                f"the TensorRT backend's buffers hold one request per forward (its profile is batch 1), "
                f"got a batch of {len(slots)}"
            )
        return self.group(slots[0])

    def group(self, slot: int) -> KVGroup:
        slot = self._slot(slot)
        g = self._group_of[slot]
        if g is None:
            g = self._group_of[slot] = BufferKVGroup(self, slot)
        return g

    def _views(self, slot: int, buffer: int, rows: int) -> KV:
        shape = (*self._lead, rows, self._d)
        keys, values = self._bufs[slot][buffer]
        return flat_view(keys, shape), flat_view(values, shape)

    def past(self, slot: int = 0) -> KV:
        """Views of the committed rows (bind as `past_keys` / `past_values`)."""
        g = self.group(slot)
        assert isinstance(g, BufferKVGroup)
        return g.past()

    def present(self, n: int, slot: int = 0) -> KV:
        """Views for the forward's `present_*` output: committed + `n` rows, in the other buffer."""
        g = self.group(slot)
        assert isinstance(g, BufferKVGroup)
        return g.present(n)

    def reset(self, slot: int = 0) -> None:
        self.group(slot).drop(slot)
