"""The runtime's shared pieces: KV stores (one contract, four memory layouts), the tap queue, the
bookkeeping checks every backend inherits, and `load_backend`.

The stores are driven through the same sequence of forwards and commits with random K/V and must hold
exactly the rows the contract says (committed prefix + kept rows, in order); copies and gathers of
float tensors are exact, so equality is the right check there.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from jetflow_pl.errors import MissingPathError, UserInputError
from jetflow_pl.head.cache import HeadCache
from jetflow_pl.runtime import BACKEND_KINDS, load_backend
from jetflow_pl.runtime.hf_cache import cache_length
from jetflow_pl.runtime.kv_store import (
    VACANT,
    BufferKVStore,
    HeadCacheStore,
    HFCacheStore,
    KVGroup,
    TensorKVStore,
)
from jetflow_pl.runtime.sequence import SequenceBackend, TapQueue, topk_to_dense
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel
from jetflow_pl.tree import accept_greedy, build_tree

L, H, D = 2, 2, 4  # layers, KV heads, head size of the store tests
#: (rows appended by a forward, rows kept: None = all) -- a prefill, two verified trees, a 1-row verify
SCHEDULE = [(5, None), (4, [0, 2]), (6, [0, 1, 4]), (1, [0])]


def _new_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 1, H, n, D, generator=g), torch.randn(L, 1, H, n, D, generator=g)


def _expected() -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = [], []
    for i, (n, keep) in enumerate(SCHEDULE):
        k, v = _new_rows(n, i)
        idx = torch.arange(n) if keep is None else torch.tensor(keep)
        keys.append(k[:, :, :, idx])
        values.append(v[:, :, :, idx])
    return torch.cat(keys, dim=3), torch.cat(values, dim=3)


class _FakeHead:
    """What `HeadCacheStore` needs of a head: a fresh `HeadCache`."""

    def new_cache(self) -> HeadCache:
        return HeadCache(L)


def _run_schedule(store, slot: int = 0) -> None:
    """Each forward appends its rows after the committed ones, the way that store's runtime does."""
    for i, (n, keep) in enumerate(SCHEDULE):
        k, v = _new_rows(n, i)
        if isinstance(store, TensorKVStore):
            pk, pv = store.past(slot)
            store.stage(n, (torch.cat([pk, k], dim=3), torch.cat([pv, v], dim=3)), slot=slot)
        elif isinstance(store, BufferKVStore):
            pk, pv = store.past(slot)
            present = store.present(n, slot)
            present[0].copy_(torch.cat([pk, k], dim=3))
            present[1].copy_(torch.cat([pv, v], dim=3))
            store.stage(n, present, slot=slot)
        elif isinstance(store, HFCacheStore):
            cache = store.cache(slot)
            for layer in range(L):
                cache.update(k[layer], v[layer], layer)
            store.stage(n, slot=slot)
        else:
            cache = store.cache(slot)
            for layer in range(L):
                cache.append(layer, k[layer], v[layer])
            store.stage(n, slot=slot)
        store.commit(None if keep is None else torch.tensor(keep), slot=slot)


def _group_rows(store, group) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's committed K/V, `[L, R, H, P, D]`."""
    if isinstance(store, (TensorKVStore, BufferKVStore)):
        return group.past()
    cache = group.cache()
    if isinstance(store, HFCacheStore):
        return torch.stack([x.keys for x in cache.layers]), torch.stack([x.values for x in cache.layers])
    return torch.stack(cache.keys), torch.stack(cache.values)


def _committed(store, slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return _group_rows(store, store.group(slot))


def _stores(num_slots: int = 1) -> dict:
    return {
        "tensor": TensorKVStore(L, H, D, num_slots=num_slots),
        "tensor_slack": TensorKVStore(L, H, D, num_slots=num_slots, keep_slack=True),
        "buffer": BufferKVStore(L, H, D, capacity=32, dtype=torch.float32, device="cpu", num_slots=num_slots),
        "hf_cache": HFCacheStore(num_slots=num_slots),
        "head_cache": HeadCacheStore(_FakeHead(), num_slots=num_slots),
    }


@pytest.mark.parametrize("kind", ["tensor", "tensor_slack", "buffer", "hf_cache", "head_cache"])
def test_every_store_keeps_the_committed_prefix_plus_the_kept_rows_in_order(kind):
    store = _stores()[kind]
    _run_schedule(store)
    want_k, want_v = _expected()
    assert store.length() == want_k.shape[3] == 5 + 2 + 3 + 1 and store.staged() == 0
    got_k, got_v = _committed(store)
    n = store.length()  # a store keeping slack may carry padding past it
    assert got_k.shape[3] == store.group(0).padded >= n
    assert torch.equal(got_k[:, :, :, :n], want_k) and torch.equal(got_v[:, :, :, :n], want_v)


@pytest.mark.parametrize("kind", ["tensor", "tensor_slack", "buffer", "hf_cache", "head_cache"])
def test_slots_are_independent_and_reset_frees_one(kind):
    store = _stores(num_slots=2)[kind]
    _run_schedule(store, slot=1)
    assert store.length(0) == 0 and store.length(1) == 11
    _run_schedule(store, slot=0)
    store.reset(1)
    assert store.length(1) == 0 and store.length(0) == 11
    got_k, _ = _committed(store, 0)
    assert torch.equal(got_k[:, :, :, :11], _expected()[0])
    with pytest.raises(IndexError, match="slot 2"):
        store.length(2)


#: per round of a two-row batch: (rows appended to every row, keeps of row 0, keeps of row 1); the rows
#: start at different lengths (5 and 2 from their prefills), so the shorter row's kept rows move down
#: over positions where its own dropped rows sit, some onto positions that other kept rows are read from
BATCH_SCHEDULE = [(4, [0, 2], [0, 1, 2, 3]), (3, [0], [1, 2]), (1, [0], [0]), (5, [], [2, 3])]


def _batch_forward(store, group, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over `group`'s rows appending `n` rows to each, as that store's runtime does; returns
    the new rows `[L, R, H, n, D]`."""
    k, v = torch.randn(2, L, group.size, H, n, D, generator=torch.Generator().manual_seed(seed))
    if isinstance(store, TensorKVStore):
        pk, pv = group.past()
        assert pk.shape[3] == group.padded
        group.stage(n, (torch.cat([pk, k], dim=3), torch.cat([pv, v], dim=3)))
        return k, v
    cache = group.cache()
    for layer in range(L):
        if isinstance(store, HFCacheStore):
            cache.update(k[layer], v[layer], layer)
        else:
            cache.append(layer, k[layer], v[layer])
    group.stage(n)
    return k, v


def _prefill_alone(store, slot: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`slot` prefilled on its own with `n` rows (one forward over its one-row group, committed), as a
    request is before it joins the batch; returns those rows `[L, 1, H, n, D]`."""
    g = store.group(slot)
    rows = _batch_forward(store, g, n, seed)
    g.commit()
    return rows


@pytest.mark.parametrize("kind", ["tensor", "tensor_slack", "hf_cache", "head_cache"])
def test_a_ragged_batch_keeps_each_rows_prefix_plus_its_own_kept_rows(kind):
    """Rows of different lengths keep different rows each round: every row must read back exactly the
    rows it kept, in order, as if decoded alone."""
    store = _stores(num_slots=2)[kind]
    want: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
    for slot, n in ((0, 5), (1, 2)):  # each slot prefilled alone, to different lengths
        want[slot].append(_prefill_alone(store, slot, n, seed=10 + slot))
    group = store.join([0, 1])
    for i, (n, *keeps) in enumerate(BATCH_SCHEDULE):
        k, v = _batch_forward(store, group, n, seed=i)
        group.commit([torch.tensor(keep, dtype=torch.long) for keep in keeps])
        for r, keep in enumerate(keeps):
            idx = torch.tensor(keep, dtype=torch.long)
            want[r].append((k[:, r : r + 1].index_select(3, idx), v[:, r : r + 1].index_select(3, idx)))
    got_k, got_v = _group_rows(store, group)
    assert got_k.shape[3] == group.padded
    assert group.padded == max(group.lengths) or kind == "tensor_slack"
    for r in range(2):
        wk, wv = (torch.cat([w[j] for w in want[r]], dim=3) for j in (0, 1))
        assert group.lengths[r] == wk.shape[3]
        n = group.lengths[r]
        assert torch.equal(got_k[:, r : r + 1, :, :n], wk) and torch.equal(got_v[:, r : r + 1, :, :n], wv)


def test_an_ar_step_of_a_ragged_batch_moves_only_the_kept_rows():
    """The commit of a ragged batch's AR step hands back the forward's own output (no copy of the batch:
    on ONNX Runtime at 16 requests a full re-gather was 27% of the round); the rows still read right."""
    store = TensorKVStore(L, H, D, num_slots=2)
    for slot, n in ((0, 5), (1, 2)):
        _prefill_alone(store, slot, n, seed=slot)
    group = store.join([0, 1])
    k, _ = _batch_forward(store, group, 1, seed=7)
    present = group._present[0]
    group.commit([torch.tensor([0]), torch.tensor([0])])
    past_k, _ = group.past()
    assert past_k.data_ptr() == present.data_ptr() and group.lengths == [6, 3]
    assert torch.equal(past_k[:, 1:2, :, 2:3], k[:, 1:2]) and torch.equal(past_k[:, 0:1, :, 5:6], k[:, 0:1])


def test_a_store_keeping_slack_keeps_a_tree_rounds_output_whole_until_the_slack_costs_more_than_a_copy():
    """`keep_slack` (the batched graphs): a commit that keeps fewer rows than it staged hands back the
    forward's own output, uncut (a cut is a strided view the next forward's runtime copies dense); the
    padding past the longest row is cut, dense, once slack^2 > 2 x longest x staged; a join into a
    vacant row and a leave carry it; every row reads back what it kept; a group of one row keeps none."""
    store = TensorKVStore(L, H, D, num_slots=3, keep_slack=True)
    alone = store.group(2)  # a group of one row keeps no slack (there the copy is the cheaper one)
    _batch_forward(store, alone, 20, seed=20)
    alone.commit()
    _batch_forward(store, alone, 8, seed=21)
    alone.commit([torch.tensor([0, 1])])
    assert alone.slack == 0 and alone.past()[0].shape[3] == 22
    store.reset(2)
    want: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    for slot, n in ((0, 9), (1, 4)):
        want[slot].append(_prefill_alone(store, slot, n, seed=slot)[0])
    group = store.join([0, 1])

    def tree_round(n: int, keeps: list[list[int]], seed: int) -> torch.Tensor:
        k, _ = _batch_forward(store, group, n, seed=seed)
        present = group._present[0]
        group.commit([torch.tensor(kp, dtype=torch.long) for kp in keeps])
        for r, kp in enumerate(keeps):
            want[group.rows[r]].append(k[:, r : r + 1].index_select(3, torch.tensor(kp, dtype=torch.long)))
        return present

    # longest 9 -> 11 with 5 staged: slack 14 - 11 = 3, 9 <= 2 * 11 * 5: kept whole, no copy
    present = tree_round(5, [[0, 1], [0]], seed=10)
    assert group.lengths == [11, 5] and group.slack == 3 and group.padded == 14
    assert group.past()[0].data_ptr() == present.data_ptr()
    # an AR round keeps the slack as it is (3^2 = 9 <= 2 * 12 * 1)
    present = tree_round(1, [[0], [0]], seed=11)
    assert group.lengths == [12, 6] and group.slack == 3 and group.past()[0].data_ptr() == present.data_ptr()
    # 8 staged, 1 kept by the longest: slack 3 + 7 = 10, 100 <= 2 * 13 * 8 = 208: still whole
    tree_round(8, [[0], [0, 3, 5]], seed=12)
    assert group.lengths == [13, 9] and group.slack == 10
    # one AR round: 10^2 = 100 > 2 * 14 * 1: cut to the longest row, dense
    present = tree_round(1, [[0], [0]], seed=13)
    past_k, past_v = group.past()
    assert group.slack == 0 and past_k.shape[3] == 14 and past_k.is_contiguous() and past_v.is_contiguous()
    assert past_k.data_ptr() != present.data_ptr()
    # a slot joining a batch that carries slack, and a slot leaving it
    tree_round(6, [[0], [0, 1]], seed=14)
    assert group.slack == 5
    want[2].append(_prefill_alone(store, 2, 3, seed=2)[0])
    width, before = group.padded, group.past()[0].data_ptr()
    store.reset(0)
    group = store.join([1, 2])  # slot 2 takes over slot 0's row in place: only its own rows are written
    assert group.rows == [2, 1] and group.lengths == [3, 12] and group.padded == width
    assert group.past()[0].data_ptr() == before
    tree_round(4, [[0, 1, 2], [0, 1]], seed=15)
    past_k, _ = group.past()
    for r, slot in enumerate(group.rows):
        wk = torch.cat(want[slot], dim=3)
        assert group.lengths[r] == wk.shape[3]
        assert torch.equal(past_k[:, r : r + 1, :, : wk.shape[3]], wk)


@pytest.mark.parametrize("kind", ["tensor", "tensor_slack", "hf_cache", "head_cache"])
def test_requests_leaving_and_joining_reuse_rows_in_place_and_every_row_reads_back_exactly(kind):
    """Continuous batching's churn: a leaving request's row turns vacant; a joiner that fits takes it
    over in place (no copy of the batch); vacancies nobody takes are dropped at the join, joiners that do
    not fit appended in one copy; a batch whose last request leaves frees its tensors. Through all of it,
    every request reads back exactly the rows it kept, as if decoded alone."""
    store = _stores(num_slots=7)[kind]
    want: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    seed = iter(range(1000))

    def prefill(slot: int, n: int) -> None:
        want[slot] = [_prefill_alone(store, slot, n, seed=next(seed))]

    def round_(slots: list[int], n: int, keep: int) -> KVGroup:
        group = store.join(slots)
        k, v = _batch_forward(store, group, n, seed=next(seed))
        idx = torch.arange(keep)
        group.commit([idx] * group.size)
        for r, slot in enumerate(group.rows):
            want[slot].append((k[:, r : r + 1].index_select(3, idx), v[:, r : r + 1].index_select(3, idx)))
        return group

    def check(group: KVGroup) -> None:
        assert VACANT not in group.rows and group.live == group.size
        got_k, got_v = _group_rows(store, group)
        assert got_k.shape[3] == group.padded  # what the next forward is told the tensors hold
        for r, slot in enumerate(group.rows):
            wk, wv = (torch.cat([w[j] for w in want[slot]], dim=3) for j in (0, 1))
            n = group.lengths[r]
            assert n == wk.shape[3]
            assert torch.equal(got_k[:, r : r + 1, :, :n], wk) and torch.equal(got_v[:, r : r + 1, :, :n], wv)

    for slot, n in ((0, 7), (1, 3), (2, 5)):
        prefill(slot, n)
    group = round_([0, 1, 2], 4, 2)  # three join at once: one copy
    assert group.rows == [0, 1, 2] and group.lengths == [9, 5, 7]
    check(group)
    store.reset(1)  # leaves: vacant until the next join, its slot is free now
    assert group.rows == [0, VACANT, 2] and group.live == 2 and store.length(1) == 0
    prefill(3, 6)  # fits the padded length (9): takes row 1 over, in place
    group = round_([0, 2, 3], 3, 1)
    assert group.rows == [0, 3, 2] and group.lengths == [10, 7, 8] and store.batch is group
    check(group)
    store.reset(0)  # the longest leaves; its replacement is longer than every row left, inside the width
    prefill(6, 9)
    group = round_([3, 2, 6], 1, 1)
    assert group.rows == [6, 3, 2] and group.lengths == [10, 8, 9]
    check(group)
    # two leave, one joiner that fits and one that does not: one row reused, the other joiner appended
    store.reset(6)
    store.reset(2)
    prefill(4, 2)
    prefill(5, 30)
    group = round_([3, 4, 5], 2, 2)
    assert sorted(group.rows) == [3, 4, 5] and group.size == 3 and group.rows[-1] == 5
    check(group)
    # one leaves and nobody joins: the vacancy is dropped at the next join
    store.reset(4)
    group = round_([3, 5], 1, 1)
    assert group.rows == [3, 5]
    check(group)
    for slot in (3, 5):  # the last request leaves: the batch holds no tensors any more
        store.reset(slot)
    assert store.batch.size == 0
    if kind.startswith("tensor"):
        assert store.batch._kv is None


def test_a_joiner_taking_a_vacant_row_costs_a_copy_of_itself_not_of_the_batch():
    """The point of vacant rows: the batch's tensors are written in place (same storage before and
    after the join), so a request replacing a finished one does not re-lay out every other request."""
    store = TensorKVStore(L, H, D, num_slots=3)
    for slot, n in ((0, 6), (1, 4)):
        _prefill_alone(store, slot, n, seed=slot)
    group = store.join([0, 1])
    past = group.past()[0]
    store.reset(0)
    k, _ = _prefill_alone(store, 2, 5, seed=9)
    assert store.join([1, 2]) is group and group.rows == [2, 1] and group.lengths == [5, 4]
    assert group.past()[0].data_ptr() == past.data_ptr()  # same tensor: nothing re-allocated
    assert torch.equal(group.past()[0][:, 0:1, :, :5], k)


def test_an_uncommitted_forward_is_discarded_by_the_next_one():
    """Two verifies without a commit between them: the second starts from the committed rows."""
    store = HFCacheStore()
    k, v = _new_rows(3, 0)
    for layer in range(L):
        store.cache().update(k[layer], v[layer], layer)
    store.stage(3)
    store.commit()
    for _ in range(2):  # verify, verify (no commit in between)
        cache = store.cache()
        assert cache_length(cache) == 3
        k2, v2 = _new_rows(4, 1)
        for layer in range(L):
            cache.update(k2[layer], v2[layer], layer)
        store.stage(4)
    store.commit(torch.tensor([1]))
    assert store.length() == 4 == cache_length(store.cache())


def test_store_checks():
    tensor = TensorKVStore(L, H, D)
    with pytest.raises(RuntimeError, match="without a staged forward"):
        tensor.commit()
    k, v = _new_rows(3, 0)
    with pytest.raises(RuntimeError, match="expected past \\+ new = 4"):
        tensor.stage(4, (k, v))
    tensor.stage(3, (k, v))
    with pytest.raises(IndexError, match="staged 3"):
        tensor.commit(torch.tensor([0, 3]))
    buffer = BufferKVStore(L, H, D, capacity=4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="capacity of 4"):
        buffer.present(5)
    with pytest.raises(RuntimeError, match="receiving buffer"):
        buffer.stage(3, (k, v))


def test_tap_queue_with_and_without_capacity_agree():
    g = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(1, n, 6, generator=g), first) for n, first in ((4, 0), (2, 4), (1, 6))]
    listed, buffered = TapQueue(), TapQueue(capacity=8, features=6)
    for taps, first in chunks:
        listed.push(taps, first)
        buffered.push(taps, first)
    (a_taps, a_pos), (b_taps, b_pos) = listed.peek(), buffered.peek()
    assert len(listed) == len(buffered) == 7
    assert torch.equal(a_taps, b_taps) and torch.equal(a_taps, torch.cat([c[0] for c in chunks], dim=1))
    assert a_pos.tolist() == b_pos.tolist() == [list(range(7))]
    buffered.clear()
    assert buffered.peek() is None
    with pytest.raises(ValueError, match="at most 8"):
        buffered.push(torch.zeros(1, 9, 6), 0)


def test_topk_to_dense_keeps_exactly_the_top_k():
    values = torch.tensor([[-0.1, -2.0], [-0.5, -0.7]])
    ids = torch.tensor([[3, 1], [0, 4]])
    dense = topk_to_dense(values, ids, 5)
    assert dense.shape == (2, 5)
    assert dense[0, 3] == -0.1 and dense[0, 1] == -2.0 and dense[1, 4] == -0.7
    assert int(torch.isfinite(dense).sum()) == 4


# ---------------------------------------------------------------------------------------------------
# the bookkeeping every backend inherits (driven through the torch backend on a tiny random target)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tiny_target_dir):
    from jetflow_pl.head import DraftHead, DraftHeadConfig

    target = TargetModel.from_pretrained(tiny_target_dir)
    torch.manual_seed(0)
    cfg = DraftHeadConfig.for_target(target.config, num_hidden_layers=1, block_size=8, mask_token_id=95)
    return target, DraftHead(cfg).eval()


def test_every_backend_is_one_bookkeeping():
    from jetflow_pl.runtime.graph_backend import GraphBackend, TorchGraphBackend
    from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend
    from jetflow_pl.runtime.tensorrt_backend import TensorRTBackend

    for cls in (TorchBackend, GraphBackend, TorchGraphBackend, OnnxRuntimeBackend, TensorRTBackend):
        assert issubclass(cls, SequenceBackend), cls
        # the protocol steps are the shared ones: no backend re-implements them
        for step in ("prefill", "draft", "verify", "commit"):
            assert getattr(cls, step) is getattr(SequenceBackend, step), (cls, step)


def test_protocol_misuse_is_refused_the_same_way(tiny_pair):
    target, head = tiny_pair
    backend = TorchBackend(target, head)
    with pytest.raises(ValueError, match="prompt is empty"):
        backend.prefill(torch.tensor([], dtype=torch.long))
    backend.prefill(torch.tensor([5, 6, 7, 8]))
    with pytest.raises(RuntimeError, match="without a preceding verify"):
        backend.commit([0])
    lp = backend.draft(9)
    with pytest.raises(RuntimeError, match="needs new context rows"):
        backend.draft(9)  # the queued taps were read by the first draft
    tree = build_tree(lp, 9, 6, 2)
    first = backend.verify(tree)
    again = backend.verify(tree)  # the first verify's rows are dropped, not stacked
    torch.testing.assert_close(again, first)
    accepted, _ = accept_greedy(tree, again.argmax(-1))
    backend.commit(accepted)
    assert backend.past_len == 4 + len(accepted) == cache_length(backend.kv.cache())
    assert len(backend.taps) == len(accepted) and backend.head_kv.length() == 4
    with pytest.raises(ValueError, match="exceeds the context limit"):
        backend.prefill(torch.zeros(backend.max_positions + 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="no draft head"):
        TorchBackend(target).draft(3)
    assert TorchBackend(target).prefill(torch.tensor([3])).shape == (target.vocab_size,)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kind", ["torch", "torch-graph"])
def test_a_causal_draft_cut_to_the_depths_a_tree_needs_drafts_those_depths_alike(
    tiny_target_dir, kind, causal
):
    """`draft(anchor, depths)`: a causal head's block is cut to `depths + 1` rows and must give the full
    block's first `depths` rows (under the causal in-block mask row d sees rows 0..d only); a bidirectional
    head's rows see the whole block, so it must ignore the cut. The torch-graph backend runs the exported
    graphs' code (the packed in-block mask is cut with the block)."""
    from jetflow_pl.head import DraftHead, DraftHeadConfig
    from jetflow_pl.runtime.graph_backend import TorchGraphBackend

    target = TargetModel.from_pretrained(tiny_target_dir)
    torch.manual_seed(0)
    cfg = DraftHeadConfig.for_target(
        target.config, num_hidden_layers=2, block_size=8, mask_token_id=95, causal=causal
    )
    head = DraftHead(cfg).eval()

    def drafted(depths: int | None) -> torch.Tensor:
        backend = TorchBackend(target, head) if kind == "torch" else TorchGraphBackend(target, head, topk=8)
        backend.prefill(torch.tensor([5, 6, 7, 8, 9, 10]))
        return backend.draft(11, depths)

    full = drafted(None)
    assert full.shape[0] == 7
    for depths in (1, 3, 7, 30):
        cut = drafted(depths)
        if not causal:
            assert torch.equal(cut, full)  # the same forward: nothing may be cut
            continue
        assert cut.shape[0] == min(depths, 7)
        # the cut forward differs from the full one only in the GEMMs' row count, i.e. in float32
        # rounding (~1e-6 relative); a row that saw the wrong rows would be off by whole nats
        torch.testing.assert_close(cut, full[: cut.shape[0]], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# load_backend
# ---------------------------------------------------------------------------------------------------


def test_load_backend_kinds_and_one_line_errors(tiny_target_dir, tiny_pair, tmp_path):
    from jetflow_pl.runtime.graph_backend import TorchGraphBackend

    target, head = tiny_pair
    assert BACKEND_KINDS == ("torch", "torch-graph", "onnxruntime", "tensorrt")
    assert isinstance(load_backend("torch", target=target, head=head), TorchBackend)
    ar = load_backend("torch", target=tiny_target_dir)  # a folder: loaded, no head = AR only
    assert isinstance(ar, TorchBackend) and ar.block_size == 1 and not ar.has_head
    graph = load_backend("graph", target=target, head=head, topk=3)  # the older name of torch-graph
    assert isinstance(graph, TorchGraphBackend) and graph.topk == 3
    with pytest.raises(ValueError, match="top-k"):
        graph.check_width(4)
    with pytest.raises(UserInputError, match="unknown backend 'onnx'"):
        load_backend("onnx", engine_dir=tmp_path)
    with pytest.raises(UserInputError, match="needs a draft head"):
        load_backend("torch-graph", target=target)
    with pytest.raises(UserInputError, match="needs the target"):
        load_backend("torch")
    with pytest.raises(UserInputError, match="needs an engine directory"):
        load_backend("onnxruntime")
    with pytest.raises(MissingPathError, match="does not exist"):
        load_backend("onnxruntime", engine_dir=tmp_path / "missing")
    with pytest.raises(MissingPathError, match="target directory"):
        load_backend("torch", target=tmp_path / "missing")
    if importlib.util.find_spec("tensorrt") is None:
        with pytest.raises(UserInputError, match="needs TensorRT"):
            load_backend("tensorrt", engine_dir=tmp_path)
