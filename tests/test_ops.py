"""`jetflow::tree_attention`: the custom op, its fake kernel and its reference against a dense-mask oracle."""

from __future__ import annotations

import pytest
import torch

from jetflow_pl.ops import packed_mask_to_dense, tree_attention, tree_attention_reference
from jetflow_pl.tree import DraftTree, pack_mask, unpack_mask


def random_case(n: int, past: int, hq: int, hkv: int, d: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    tree = DraftTree.from_parents(torch.zeros(n, dtype=torch.long), torch.tensor(parents))
    q = torch.randn(1, hq, n, d, generator=gen)
    pk, pv = torch.randn(2, 1, hkv, past, d, generator=gen)
    k, v = torch.randn(2, 1, hkv, n, d, generator=gen)
    return (q, pk, pv, k, v, tree.packed_mask(), d**-0.5), tree.ancestor_mask()


def oracle(q, pk, pv, k, v, dense_tree: torch.Tensor, scale: float) -> torch.Tensor:
    """Explicit softmax over [prefix ; visible tree rows], one query head at a time (no SDPA)."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for h in range(hq):
        g = h // (hq // hkv)
        keys = torch.cat([pk[0, g], k[0, g]])
        vals = torch.cat([pv[0, g], v[0, g]])
        scores = q[0, h] @ keys.T * scale
        visible = torch.cat([torch.ones(q.shape[2], pk.shape[2], dtype=torch.bool), dense_tree], dim=1)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[0, h] = torch.softmax(scores, dim=-1) @ vals
    return out


@pytest.mark.parametrize(
    "n,past,hq,hkv",
    [(1, 0, 2, 2), (5, 0, 4, 2), (33, 7, 4, 1), (70, 3, 6, 3), (256, 12, 2, 2)],
)
def test_op_and_reference_match_an_explicit_softmax(n, past, hq, hkv):
    args, dense = random_case(n, past, hq, hkv, seed=n)
    want = oracle(*args[:5], dense, args[6])
    assert torch.allclose(tree_attention_reference(*args), want, atol=1e-5)
    assert torch.allclose(tree_attention(*args), want, atol=1e-5)


def test_mask_bits_really_gate_the_tree_rows():
    args, dense = random_case(40, 4, 2, 2, seed=5)
    chain = pack_mask(torch.ones(40, 40, dtype=torch.bool).tril())
    assert not torch.allclose(tree_attention(*args), tree_attention(*args[:5], chain, args[6]))


def test_packed_mask_to_dense_inverts_pack_mask_including_bit_31():
    gen = torch.Generator().manual_seed(0)
    dense = torch.rand(65, 65, generator=gen) > 0.5
    dense[:, 31] = True  # negative words
    packed = pack_mask(dense)
    assert int(packed[:, 0].min()) < 0
    assert torch.equal(packed_mask_to_dense(packed), dense)
    assert torch.equal(unpack_mask(packed, 65), dense)


def test_fake_kernel_and_schema_pass_opcheck():
    args, _ = random_case(9, 3, 4, 2, seed=2)
    torch.library.opcheck(torch.ops.jetflow.tree_attention.default, args)


def test_bad_shapes_and_mask_dtype_are_refused():
    args, _ = random_case(4, 2, 3, 2, seed=1)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tree_attention_reference(*args)
    good, _ = random_case(4, 2, 4, 2, seed=1)
    with pytest.raises(ValueError, match="int32"):
        tree_attention_reference(*good[:5], good[5].to(torch.int64), good[6])


def test_masked_attention_path_equals_the_tree_attention_reference():
    """The `attention` export variant's decomposition computes the same contract."""
    from jetflow_pl.ops.tree_attention import tree_attention_via_masked_attention

    args, _ = random_case(45, 6, 4, 2, seed=7)
    assert torch.allclose(
        tree_attention_via_masked_attention(*args), tree_attention_reference(*args), atol=1e-6
    )
    q, pk, pv, k, v, mask, scale = args
    keys, values = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
    visible = torch.ones(45, 51, dtype=torch.bool)
    torch.library.opcheck(torch.ops.jetflow.masked_attention.default, (q, keys, values, visible, scale))
