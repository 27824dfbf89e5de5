"""`jetflow_pl.masks`: the packed layout's one home, and the batch packer the batched verify graph takes."""

from __future__ import annotations

import pytest
import torch

import jetflow_pl.tree as tree_module
from jetflow_pl import masks
from jetflow_pl.masks import block_mask, chain_mask, pack_mask, pack_mask_batch, pack_tree_batch, unpack_mask
from jetflow_pl.tree import DraftTree, build_tree


def random_tree(n: int, gen: torch.Generator) -> DraftTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    tokens = torch.randint(0, 100, (n,), generator=gen)
    return DraftTree.from_parents(tokens, torch.tensor(parents))


def test_tree_module_reexports_the_same_packers():
    assert tree_module.pack_mask is masks.pack_mask
    assert tree_module.unpack_mask is masks.unpack_mask


def test_chain_and_block_masks():
    for n in (1, 31, 32, 33, 70):
        assert torch.equal(unpack_mask(chain_mask(n), n), torch.ones(n, n, dtype=torch.bool).tril())
        assert torch.equal(chain_mask(n), DraftTree.chain(torch.zeros(n, dtype=torch.long)).packed_mask())
        assert torch.equal(block_mask(n, causal=True), chain_mask(n))
        assert torch.equal(unpack_mask(block_mask(n, causal=False), n), torch.ones(n, n, dtype=torch.bool))
    assert block_mask(32, causal=False).tolist() == [[-1]] * 32  # all 32 bits: -1 in two's complement


def test_pack_tree_batch_layout_lengths_offsets_and_padding():
    gen = torch.Generator().manual_seed(0)
    trees = [random_tree(n, gen) for n in (5, 40, 1)]
    trees.append(build_tree(torch.log_softmax(torch.randn(4, 30, generator=gen), -1), 7, budget=20, width=3))
    batch = pack_tree_batch(trees)
    sizes = [t.num_nodes for t in trees]
    n = max(sizes)
    assert batch.packed_mask.shape == (4, n, 2) and batch.packed_mask.dtype == torch.int32
    assert batch.generation_lengths.tolist() == sizes and batch.generation_lengths.dtype == torch.int32
    assert batch.position_offsets.shape == (4, n) and batch.position_offsets.dtype == torch.int64
    for b, tree in enumerate(trees):
        m = tree.num_nodes
        dense = unpack_mask(batch.packed_mask[b], n)
        assert torch.equal(dense[:m, :m], tree.ancestor_mask())
        assert not dense[m:].any() and not dense[:, m:].any()  # padding rows see nothing, nobody sees them
        assert torch.equal(batch.position_offsets[b, :m], tree.depths)
        assert not batch.position_offsets[b, m:].any()
        assert torch.equal(batch.packed_mask[b, :m, : (m + 31) // 32], tree.packed_mask())
    past = torch.tensor([10, 0, 3, 7])
    ids = batch.position_ids(past)
    assert torch.equal(ids[1, :40], trees[1].position_ids(0)) and torch.equal(
        ids[0, 5:], torch.full((35,), 10)
    )


def test_pack_tree_batch_to_a_fixed_engine_shape_and_bad_input():
    gen = torch.Generator().manual_seed(1)
    trees = [random_tree(3, gen), random_tree(9, gen)]
    batch = pack_tree_batch(trees, num_nodes=64)
    assert batch.packed_mask.shape == (2, 64, 2) and batch.num_nodes == 64 and batch.batch_size == 2
    with pytest.raises(ValueError, match="smaller than the largest"):
        pack_tree_batch(trees, num_nodes=8)
    with pytest.raises(ValueError, match="at least one"):
        pack_tree_batch([])
    with pytest.raises(ValueError, match="square bool"):
        pack_mask_batch([torch.ones(2, 3, dtype=torch.bool)])
    with pytest.raises(ValueError, match="one entry per request"):
        batch.position_ids([1, 2, 3])


def test_pack_mask_batch_matches_per_mask_packing_with_bit_31():
    gen = torch.Generator().manual_seed(2)
    dense = [torch.rand(n, n, generator=gen) > 0.5 for n in (33, 64, 2)]
    dense[1][:, 31] = True
    packed, lengths = pack_mask_batch(dense)
    assert (packed[1, :, 0] < 0).all() and lengths.tolist() == [33, 64, 2]
    for b, d in enumerate(dense):
        m = d.shape[0]
        assert torch.equal(packed[b, :m, : (m + 31) // 32], pack_mask(d))
