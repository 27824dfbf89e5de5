"""Fuzz (issue 9): random trees, masks and distributions through builder -> packer -> acceptance.

tests/test_tree.py already fuzzes the builder against a reference, pack/unpack round trips, ancestor
masks and greedy acceptance with small vocabularies. What it does not cover, and this file does:
the export/kernel-side unpacker `jetflow_pl.ops.packed_mask_to_dense` against `tree.pack_mask`; built
trees (with -inf and tied log-probs, random fan-out caps) carried end to end through the packer and a
greedy acceptance checked against an independent target-greedy oracle; sampling acceptance with sparse
distributions; and malformed trees/masks, which must fail with ValueError and nothing else.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jetflow_pl.ops import packed_mask_to_dense
from jetflow_pl.tree import (
    DraftTree,
    Top2GapCap,
    accept_greedy,
    accept_sampling,
    build_tree,
    pack_mask,
    unpack_mask,
)

FUZZ = settings(max_examples=80, deadline=None, derandomize=True)


@st.composite
def random_tree(draw, max_nodes: int = 100, vocab: int = 5) -> DraftTree:
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    return DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents))


@FUZZ
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    cols=st.integers(1, 130),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_ops_unpacker_inverts_pack_mask_on_random_masks(lead, cols, density, seed):
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(*lead, 2, cols, generator=g) < density
    packed = pack_mask(dense)
    assert packed.dtype == torch.int32 and packed.shape[-1] == (cols + 31) // 32
    assert torch.equal(packed_mask_to_dense(packed, cols), dense)
    assert torch.equal(unpack_mask(packed, cols), dense)


@FUZZ
@given(tree=random_tree())
def test_ops_unpacker_reads_tree_masks_as_the_verify_step_sees_them(tree):
    n = tree.num_nodes
    anc = tree.ancestor_mask()
    dense = packed_mask_to_dense(tree.packed_mask())  # n defaults to the square size
    assert dense.shape == (n, n) and torch.equal(dense, anc)
    visible = tree.additive_mask(3)[0, 0, :, 3:] == 0
    assert torch.equal(visible, dense)


def oracle_next(prefix: tuple[int, ...], vocab: int) -> int:
    """A deterministic stand-in for a target's greedy next token given the whole path."""
    return hashlib.sha256(repr(prefix).encode()).digest()[0] % vocab


@FUZZ
@given(
    depth=st.integers(1, 6),
    vocab=st.integers(2, 7),
    budget=st.integers(0, 60),
    width=st.integers(1, 5),
    gap=st.one_of(st.none(), st.floats(0.0, 3.0)),
    data=st.data(),
)
def test_built_trees_survive_packing_and_accept_exactly_the_target_greedy_path(
    depth, vocab, budget, width, gap, data
):
    # integer-ish log-probs (many ties) with some -inf entries (tokens a head rules out)
    cells = data.draw(
        st.lists(st.one_of(st.integers(-6, 0), st.just(None)), min_size=depth * vocab, max_size=depth * vocab)
    )
    lp = torch.tensor([float("-inf") if c is None else c / 2 for c in cells]).reshape(depth, vocab)
    root = data.draw(st.integers(0, vocab - 1))
    tree = build_tree(lp, root, budget, width, Top2GapCap(gap) if gap is not None else None)
    n = tree.num_nodes
    assert 1 <= n <= budget + 1 and int(tree.depths.max()) <= depth
    for i in range(n):  # siblings carry distinct tokens: the acceptance walk is unambiguous
        kids = [int(tree.tokens[c]) for c in tree.children(i)]
        assert len(kids) == len(set(kids)) <= width
    assert torch.equal(packed_mask_to_dense(pack_mask(tree.ancestor_mask()), n), tree.ancestor_mask())

    # the target's argmax at node i is its greedy next token after the path root..i
    base = tuple(data.draw(st.lists(st.integers(0, vocab - 1), max_size=4), label="prefix"))
    paths = [tuple(int(tree.tokens[j]) for j in tree.path(i)) for i in range(n)]
    argmax = torch.tensor([oracle_next(base + p, vocab) for p in paths])
    accepted, bonus = accept_greedy(tree, argmax)
    committed = [int(tree.tokens[j]) for j in accepted[1:]] + [bonus]
    # independent check: plain greedy decoding from base + root for the same number of tokens
    seq, want = base + (root,), []
    for _ in committed:
        want.append(oracle_next(seq, vocab))
        seq += (want[-1],)
    assert committed == want
    # and the walk stopped only because the tree has no child with the next greedy token
    assert bonus not in [int(tree.tokens[c]) for c in tree.children(accepted[-1])]


@FUZZ
@given(tree=random_tree(max_nodes=40, vocab=6), data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_sampling_acceptance_never_commits_a_zero_probability_token(tree, data, seed):
    n, vocab = tree.num_nodes, 6
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(n, vocab, generator=g)
    zero = torch.rand(n, vocab, generator=g) < data.draw(st.floats(0.0, 0.9), label="sparsity")
    zero[torch.arange(n), torch.randint(0, vocab, (n,), generator=g)] = False  # each row keeps mass
    probs[zero] = 0.0
    accepted, token = accept_sampling(tree, probs, torch.Generator().manual_seed(seed))
    assert accepted[0] == 0 and accepted == tree.path(accepted[-1])
    for a, b in zip(accepted[:-1], accepted[1:], strict=True):
        t = int(tree.tokens[b])
        assert probs[a, t] > 0
        assert b == min(c for c in tree.children(a) if int(tree.tokens[c]) == t)  # first child rule
    assert probs[accepted[-1], token] > 0
    assert token not in [int(tree.tokens[c]) for c in tree.children(accepted[-1])]


@FUZZ
@given(
    parents=st.lists(st.integers(-3, 50), min_size=0, max_size=30),
    words=st.integers(0, 3),
    n=st.integers(-2, 140),
)
def test_malformed_trees_and_masks_fail_with_value_error_only(parents, words, n):
    try:
        tree = DraftTree.from_parents(torch.zeros(len(parents), dtype=torch.long), torch.tensor(parents))
    except ValueError:
        pass
    else:  # accepted only when well formed
        assert tree.parents.tolist() == parents and parents[0] == -1
        assert all(0 <= p < i for i, p in enumerate(parents) if i)
    packed = torch.zeros(2, words, dtype=torch.int32)
    if 0 <= n <= 32 * words:
        assert unpack_mask(packed, n).shape == (2, n)
    else:
        with pytest.raises(ValueError):
            unpack_mask(packed, n)
    with pytest.raises(ValueError):
        packed_mask_to_dense(packed.to(torch.int64), 1)
