"""Tests for jetflow_pl.tree: builder, fan-out policies, masks, acceptance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jetflow_pl.tree import (
    DraftTree,
    FanoutPolicy,
    FixedWidth,
    Top2GapCap,
    accept_greedy,
    accept_sampling,
    build_tree,
    pack_mask,
    rescore_and_select,
    stable_topk,
    unpack_mask,
)

FUZZ = settings(max_examples=60, deadline=None, derandomize=True)


def lp(rows):
    return torch.tensor(rows, dtype=torch.float32)


def assert_tree(tree, tokens, parents, depths, scores=None):
    assert tree.tokens.tolist() == tokens
    assert tree.parents.tolist() == parents
    assert tree.depths.tolist() == depths
    if scores is not None:
        assert tree.scores.tolist() == pytest.approx(scores)
    assert tree.tokens.dtype == tree.parents.dtype == tree.depths.dtype == torch.long
    assert tree.scores.dtype == torch.float32


# ---- strategies / references -----------------------------------------------------------------------


@st.composite
def random_parents(draw, max_nodes=40):
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@st.composite
def random_tree(draw, max_nodes=40, vocab=4):
    parents = draw(random_parents(max_nodes))
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=len(parents), max_size=len(parents)))
    return DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents))


def naive_ancestors(parents):
    n = len(parents)
    m = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            m[i][j] = True
            j = parents[j]
    return torch.tensor(m, dtype=torch.bool)


def naive_pack(dense):
    rows, m = dense.shape
    words = (m + 31) // 32
    out = []
    for r in range(rows):
        row = []
        for w in range(words):
            v = sum(1 << b for b in range(32) if 32 * w + b < m and bool(dense[r, 32 * w + b]))
            row.append(v - (1 << 32) if v >= 1 << 31 else v)
        out.append(row)
    return torch.tensor(out, dtype=torch.int32).reshape(rows, words)


def reference_build(rows, root, budget, width):
    """Oracle: the best-first rule written out plainly (linear scans, Python sorts, no heap)."""
    order = [sorted(range(len(r)), key=lambda t, r=r: (-r[t], t))[:width] for r in rows]
    tokens, parents, depths, scores = [root], [-1], [0], [0.0]
    frontier = [0]
    while frontier and len(tokens) - 1 < budget:
        best = max(frontier, key=lambda i: (scores[i], -i))
        frontier.remove(best)
        d = depths[best]
        if d >= len(rows):
            continue
        for t in order[d]:
            if len(tokens) - 1 == budget:
                break
            tokens.append(t)
            parents.append(best)
            depths.append(d + 1)
            scores.append(scores[best] + rows[d][t])
            frontier.append(len(tokens) - 1)
    return tokens, parents, depths, scores


# ---- DraftTree -------------------------------------------------------------------------------------


def test_from_parents_derives_depths_and_structure():
    t = DraftTree.from_parents(torch.tensor([10, 5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1, 3]))
    assert t.depths.tolist() == [0, 1, 1, 2, 3]
    assert t.num_nodes == len(t) == 5
    assert t.budget == 4
    assert t.max_depth == 3
    assert t.children(0) == [1, 2]
    assert t.children(1) == [3]
    assert t.children(4) == []
    assert t.path(4) == [0, 1, 3, 4]
    assert t.path(0) == [0]
    assert t.scores.tolist() == [0.0] * 5
    assert t.position_ids(7).tolist() == [7, 8, 8, 9, 10]


def test_chain_constructor():
    t = DraftTree.chain(torch.tensor([3, 1, 4, 1]))
    assert_tree(t, [3, 1, 4, 1], [-1, 0, 1, 2], [0, 1, 2, 3])
    assert t.children(1) == [2]


@pytest.mark.parametrize(
    "parents, depths, match",
    [
        ([-1, 0, 2], [0, 1, 1], "parent-before-child"),  # parent not earlier
        ([-1, 0, 1], [0, 1, 1], "depth"),  # wrong depth
        ([0, 0, 1], [0, 1, 2], "root"),  # root parent not -1
        ([-1, 0, -1], [0, 1, 1], "parent-before-child"),  # second root
    ],
)
def test_validate_rejects_malformed_trees(parents, depths, match):
    with pytest.raises(ValueError, match=match):
        DraftTree(
            tokens=torch.zeros(3, dtype=torch.long),
            parents=torch.tensor(parents),
            depths=torch.tensor(depths),
            scores=torch.zeros(3),
        )


def test_validate_rejects_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="parents"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1]), torch.tensor([0, 1]), torch.zeros(2))
    with pytest.raises(ValueError, match="integer"):
        DraftTree.chain(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="at least the root"):
        DraftTree.chain(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="parent-before-child"):
        DraftTree.from_parents(torch.tensor([1, 2]), torch.tensor([-1, 1]))


# ---- builder: hand-worked cases ----------------------------------------------------------------------

# V = 5, D = 3. Top-2 per depth (descending):
#   depth 1: tok1 (-0.5), tok2 (-1.0)
#   depth 2: tok0 (-0.25), tok3 (-1.5)
#   depth 3: tok2 (-0.75), tok3 (-1.25)
HAND = [
    [-3.0, -0.5, -1.0, -4.0, -2.0],
    [-0.25, -5.0, -5.0, -1.5, -2.0],
    [-6.0, -6.0, -0.75, -1.25, -6.0],
]


def test_budget_not_multiple_of_width_stops_mid_expansion():
    # pop root -> n1 (tok1, -0.5), n2 (tok2, -1.0)
    # pop n1 (-0.5) -> n3 (tok0, -0.75), n4 (tok3, -2.0)
    # pop n3 (-0.75, deeper, beats n2 at -1.0) -> n5 (tok2, -1.5); budget 5 reached, tok3 never added
    t = build_tree(lp(HAND), root_token=4, budget=5, width=2)
    assert_tree(
        t,
        tokens=[4, 1, 2, 0, 3, 2],
        parents=[-1, 0, 0, 1, 1, 3],
        depths=[0, 1, 1, 2, 2, 3],
        scores=[0.0, -0.5, -1.0, -0.75, -2.0, -1.5],
    )
    assert t.budget == 5


def test_deep_path_beats_shallow_sibling():
    # As above, but budget 7: n3 also gets n6 (tok3, -2.0); then the frontier is
    # n2 (-1.0), n5 (-1.5), n4 (-2.0), n6 (-2.0) and n2 is expanded: n7 (tok0, -1.25).
    t = build_tree(lp(HAND), root_token=4, budget=7, width=2)
    assert_tree(
        t,
        tokens=[4, 1, 2, 0, 3, 2, 3, 0],
        parents=[-1, 0, 0, 1, 1, 3, 3, 2],
        depths=[0, 1, 1, 2, 2, 3, 3, 2],
        scores=[0.0, -0.5, -1.0, -0.75, -2.0, -1.5, -2.0, -1.25],
    )


def test_best_first_skips_weak_depth1_sibling_entirely():
    # depth 1: tok0 (-0.1), tok1 (-3.0); depth 2: tok1 (-0.2), tok2 (-0.3);
    # depth 3: tok0 (-0.4), then tok1 / tok2 tie at -9 -> tok1 (lower id).
    rows = [[-0.1, -3.0, -9.0], [-9.0, -0.2, -0.3], [-0.4, -9.0, -9.0]]
    t = build_tree(lp(rows), root_token=0, budget=6, width=2)
    # root -> n1 tok0 (-0.1), n2 tok1 (-3.0); n1 -> n3 tok1 (-0.3), n4 tok2 (-0.4);
    # n3 (-0.3) -> n5 tok0 (-0.7), n6 tok1 (-9.3). n2 at -3.0 is never expanded.
    assert_tree(
        t,
        tokens=[0, 0, 1, 1, 2, 0, 1],
        parents=[-1, 0, 0, 1, 1, 3, 3],
        depths=[0, 1, 1, 2, 2, 3, 3],
        scores=[0.0, -0.1, -3.0, -0.3, -0.4, -0.7, -9.3],
    )
    assert t.children(2) == []


def test_equal_logprob_tie_goes_to_lower_token_id():
    rows = [[-1.0, -0.5, -2.0, -0.5, -0.5]]
    t = build_tree(lp(rows), root_token=9, budget=3, width=3)
    assert t.tokens.tolist() == [9, 1, 3, 4]
    t = build_tree(lp(rows), root_token=9, budget=2, width=2)
    assert t.tokens.tolist() == [9, 1, 3]
    # all-equal wide row: topk alone may return any tied ids, the rule says 0, 1, 2, 3
    flat = torch.full((1, 257), -2.0)
    assert build_tree(flat, 0, budget=4, width=4).tokens.tolist() == [0, 0, 1, 2, 3]


def test_equal_score_tie_goes_to_earlier_inserted_node():
    # depth 1: tok0 (-1), tok1 (-2); depth 2: tok0 (-1), tok1 (-3); depth 3: tok0 (-0.5)
    # root -> n1 (-1), n2 (-2); n1 -> n3 (-2, depth 2), n4 (-4).
    # n2 and n3 tie at -2: n2 was inserted first, so n2 is expanded -> n5 = tok0 under n2 (depth 2).
    rows = [[-1.0, -2.0, -9.0], [-1.0, -3.0, -9.0], [-0.5, -9.0, -9.0]]
    t = build_tree(lp(rows), root_token=7, budget=5, width=2)
    assert_tree(
        t,
        tokens=[7, 0, 1, 0, 1, 0],
        parents=[-1, 0, 0, 1, 1, 2],
        depths=[0, 1, 1, 2, 2, 2],
        scores=[0.0, -1.0, -2.0, -2.0, -4.0, -3.0],
    )
    # equal scores among siblings too: both depth-1 children at -1, the first (tok0) is expanded first
    rows = [[-1.0, -1.0, -5.0], [-0.5, -7.0, -0.25]]
    t = build_tree(lp(rows), root_token=2, budget=3, width=2)
    assert_tree(t, [2, 0, 1, 2], [-1, 0, 0, 1], [0, 1, 1, 2], [0.0, -1.0, -1.0, -1.25])


def test_width_one_is_chain_of_argmaxes():
    torch.manual_seed(0)
    rows = torch.log_softmax(torch.randn(6, 50), dim=-1)
    argmax = rows.argmax(dim=-1).tolist()
    t = build_tree(rows, root_token=11, budget=10, width=1)  # D = 6 < budget: stops at depth 6
    chain = DraftTree.chain(torch.tensor([11] + argmax))
    for name in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(t, name), getattr(chain, name))
    assert t.scores.tolist() == pytest.approx(
        [0.0] + torch.cumsum(rows.max(dim=-1).values, 0).tolist(), abs=1e-5
    )
    t3 = build_tree(rows, root_token=11, budget=3, width=1)
    assert t3.tokens.tolist() == [11] + argmax[:3]
    assert t3.parents.tolist() == [-1, 0, 1, 2]


def test_budget_zero_is_root_only():
    t = build_tree(lp(HAND), root_token=3, budget=0, width=4)
    assert_tree(t, [3], [-1], [0], [0.0])
    assert t.budget == 0 and t.max_depth == 0
    assert t.ancestor_mask().tolist() == [[True]]


def test_budget_larger_than_possible_stops_early():
    rows = lp([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]])
    t = build_tree(rows, root_token=0, budget=100, width=2)
    assert t.budget == 2 + 4  # every node at depth < 2 expanded with 2 children
    assert t.max_depth == 2
    t = build_tree(rows, root_token=0, budget=100, width=10)  # width > V: all 3 tokens
    assert t.budget == 3 + 9
    assert sorted(t.tokens[t.depths == 1].tolist()) == [0, 1, 2]


def test_builder_argument_validation():
    rows = lp(HAND)
    with pytest.raises(ValueError, match="budget"):
        build_tree(rows, 0, budget=-1, width=2)
    with pytest.raises(ValueError, match="width"):
        build_tree(rows, 0, budget=3, width=0)
    with pytest.raises(ValueError, match="empty"):
        build_tree(torch.empty(0, 5), 0, budget=3, width=2)
    with pytest.raises(ValueError, match="empty"):
        build_tree(torch.empty(3, 0), 0, budget=3, width=2)
    with pytest.raises(ValueError, match=r"\[D, V\]"):
        build_tree(torch.zeros(5), 0, budget=3, width=2)
    with pytest.raises(ValueError, match="NaN"):
        build_tree(lp([[0.0, float("nan")]]), 0, budget=1, width=1)
    with pytest.raises(ValueError, match="root_token"):
        build_tree(rows, -1, budget=1, width=1)


@FUZZ
@given(
    depth=st.integers(1, 4),
    vocab=st.integers(1, 6),
    budget=st.integers(0, 30),
    width=st.integers(1, 4),
    data=st.data(),
)
def test_builder_matches_reference_and_invariants(depth, vocab, budget, width, data):
    # small integer log-probs make ties (token and score) frequent
    ints = data.draw(
        st.lists(st.integers(-4, 0), min_size=depth * vocab, max_size=depth * vocab), label="logprobs"
    )
    rows = torch.tensor(ints, dtype=torch.float32).reshape(depth, vocab) / 2
    t = build_tree(rows, root_token=vocab, budget=budget, width=width)
    ref_tokens, ref_parents, ref_depths, ref_scores = reference_build(rows.tolist(), vocab, budget, width)
    assert t.tokens.tolist() == ref_tokens
    assert t.parents.tolist() == ref_parents
    assert t.depths.tolist() == ref_depths
    k = min(width, vocab)
    max_possible = sum(k**d for d in range(1, depth + 1))
    assert t.budget == min(budget, max_possible)
    par = t.parents.tolist()
    for i in range(1, t.num_nodes):
        assert par[i] < i
        assert t.depths[i] == t.depths[par[i]] + 1
        # score equals the sum of path log-probs
        path_sum = sum(float(rows[t.depths[j] - 1, t.tokens[j]]) for j in t.path(i)[1:])
        assert float(t.scores[i]) == pytest.approx(path_sum)
    assert float(t.scores[0]) == 0.0
    assert t.scores.tolist() == pytest.approx(ref_scores)


def test_builder_stable_topk_helper():
    x = lp([[0.0, 1.0, 1.0, -1.0, 1.0], [-2.0, -2.0, -2.0, -2.0, -2.0]])
    vals, ids = stable_topk(x, 3)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert vals.tolist() == [[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]


# ---- fan-out policies ------------------------------------------------------------------------------


def test_top2gap_cap_hand_case():
    # gaps: depth 1 -> 2.9 (> 1: one child), depth 2 -> 0.5 (two), depth 3 -> 1.75 (one)
    rows = [[-0.1, -3.0, -4.0, -5.0], [-1.0, -1.5, -3.0, -4.0], [-0.25, -2.0, -4.0, -5.0]]
    t = build_tree(lp(rows), root_token=9, budget=10, width=2, policy=Top2GapCap(max_gap=1.0))
    # root -> n1 tok0 (-0.1); n1 -> n2 tok0 (-1.1), n3 tok1 (-1.6); n2 -> n4 tok0 (-1.35);
    # n4 is at depth D; n3 -> n5 tok0 (-1.85). Frontier exhausted at 5 < budget.
    assert_tree(
        t,
        tokens=[9, 0, 0, 1, 0, 0],
        parents=[-1, 0, 1, 1, 2, 3],
        depths=[0, 1, 2, 2, 3, 3],
        scores=[0.0, -0.1, -1.1, -1.6, -1.35, -1.85],
    )


def test_policy_units():
    assert Top2GapCap(1.0).num_children(1, lp([-0.5, -1.5]), 4) == 4  # gap == max_gap: not capped
    assert Top2GapCap(1.0).num_children(1, lp([-0.5, -1.75]), 4) == 1
    assert Top2GapCap(1.0).num_children(1, lp([-0.5]), 1) == 1
    assert FixedWidth().num_children(3, lp([0.0, -1.0]), 5) == 5
    assert isinstance(Top2GapCap(0.5), FanoutPolicy)
    assert isinstance(FixedWidth(), FanoutPolicy)


class _Recording:
    def __init__(self, answer):
        self.answer = answer
        self.calls = []

    def num_children(self, depth, topk_logprobs, width):
        self.calls.append((depth, topk_logprobs.tolist(), width))
        return self.answer


def test_policy_called_once_per_depth_with_topk_and_clamped():
    rows = lp(HAND)
    pol = _Recording(answer=99)  # more than width: clamped to width
    t = build_tree(rows, 0, budget=100, width=2, policy=pol)
    assert pol.calls == [(1, [-0.5, -1.0], 2), (2, [-0.25, -1.5], 2), (3, [-0.75, -1.25], 2)]
    assert t.budget == 2 + 4 + 8
    pol0 = _Recording(answer=0)  # zero children: the root stays a leaf
    assert build_tree(rows, 0, budget=5, width=2, policy=pol0).num_nodes == 1


# ---- masks -----------------------------------------------------------------------------------------


def test_packed_mask_single_node():
    p = DraftTree.chain(torch.tensor([5])).packed_mask()
    assert p.dtype == torch.int32
    assert p.tolist() == [[1]]


def test_packed_mask_33_nodes_two_words():
    chain = DraftTree.chain(torch.arange(33))
    p = chain.packed_mask()
    assert p.shape == (33, 2) and p.dtype == torch.int32
    assert p[0].tolist() == [1, 0]
    assert p[1].tolist() == [3, 0]
    assert p[31].tolist() == [-1, 0]  # bits 0..31 all set
    assert p[32].tolist() == [-1, 1]
    # star: every node a child of the root; row 31 = bits {0, 31} = 1 + 2**31 -> 1 - 2**31 as int32
    star = DraftTree.from_parents(torch.arange(33), torch.tensor([-1] + [0] * 32))
    s = star.packed_mask()
    assert s[31].tolist() == [-2147483647, 0]
    assert s[30].tolist() == [1 + (1 << 30), 0]
    assert s[32].tolist() == [1, 1]


def test_pack_mask_bit31_only_is_int32_min():
    dense = torch.zeros(1, 32, dtype=torch.bool)
    dense[0, 31] = True
    assert pack_mask(dense).tolist() == [[-2147483648]]
    assert unpack_mask(pack_mask(dense), 32).tolist() == dense.tolist()


def test_packed_mask_long_chain_row40():
    p = DraftTree.chain(torch.zeros(45, dtype=torch.long)).packed_mask()
    assert p.shape == (45, 2)
    assert p[40].tolist() == [-1, (1 << 9) - 1]
    assert p[44].tolist() == [-1, (1 << 13) - 1]


@FUZZ
@given(rows=st.integers(1, 5), cols=st.integers(1, 100), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(rows, cols, generator=g) < 0.5
    packed = pack_mask(dense)
    assert packed.dtype == torch.int32
    assert packed.shape == (rows, (cols + 31) // 32)
    assert torch.equal(packed, naive_pack(dense))
    assert torch.equal(unpack_mask(packed, cols), dense)


def test_unpack_mask_validation():
    with pytest.raises(ValueError):
        unpack_mask(torch.zeros(2, 1, dtype=torch.int32), 33)
    with pytest.raises(ValueError):
        pack_mask(torch.zeros(2, 3))


@FUZZ
@given(parents=random_parents(max_nodes=80))
def test_ancestor_mask_matches_naive(parents):
    n = len(parents)
    t = DraftTree.from_parents(torch.zeros(n, dtype=torch.long), torch.tensor(parents))
    anc = t.ancestor_mask()
    assert anc.dtype == torch.bool and anc.shape == (n, n)
    assert torch.equal(anc, naive_ancestors(parents))
    assert torch.equal(t.packed_mask(), naive_pack(anc))
    assert torch.equal(unpack_mask(t.packed_mask(), n), anc)
    for i in range(n):
        assert torch.nonzero(anc[i]).flatten().tolist() == t.path(i)


@FUZZ
@given(tree=random_tree(max_nodes=20), past_len=st.integers(0, 6))
def test_additive_mask_consistent_with_ancestor_mask(tree, past_len):
    n = tree.num_nodes
    anc = tree.ancestor_mask()
    for dtype in (torch.float32, torch.float16):
        m = tree.additive_mask(past_len, dtype)
        assert m.shape == (1, 1, n, past_len + n) and m.dtype == dtype
        assert bool((m[0, 0, :, :past_len] == 0).all())  # the whole KV prefix is visible
        block = m[0, 0, :, past_len:]
        assert torch.equal(block == 0, anc)
        assert bool((block[~anc] == torch.finfo(dtype).min).all())
    assert tree.position_ids(past_len).tolist() == [past_len + d for d in tree.depths.tolist()]


# ---- acceptance ------------------------------------------------------------------------------------

# root 10 ; n1 = 5 (under root), n2 = 6 (under root), n3 = 7 (under n1), n4 = 8 (under n3)
ACC_TREE = DraftTree.from_parents(torch.tensor([10, 5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1, 3]))


def test_accept_greedy_full_path():
    acc, bonus = accept_greedy(ACC_TREE, torch.tensor([5, 7, 0, 8, 42]))
    assert acc == [0, 1, 3, 4]
    assert bonus == 42


def test_accept_greedy_none_accepted_bonus_from_root():
    acc, bonus = accept_greedy(ACC_TREE, torch.tensor([9, 7, 0, 8, 42]))
    assert acc == [0]
    assert bonus == 9


def test_accept_greedy_partial_second_branch():
    acc, bonus = accept_greedy(ACC_TREE, torch.tensor([6, 7, 3, 8, 42]))
    assert acc == [0, 2]
    assert bonus == 3


def test_accept_greedy_duplicate_sibling_tokens_takes_first_child():
    # n1 and n2 both carry 5; only n2 has a child with 7. The walk must take n1 and stop there.
    t = DraftTree.from_parents(torch.tensor([10, 5, 5, 7]), torch.tensor([-1, 0, 0, 2]))
    acc, bonus = accept_greedy(t, torch.tensor([5, 7, 7, 1]))
    assert acc == [0, 1]
    assert bonus == 7


def test_accept_greedy_validates_shape():
    with pytest.raises(ValueError):
        accept_greedy(ACC_TREE, torch.tensor([5, 7]))
    with pytest.raises(ValueError):
        accept_sampling(ACC_TREE, torch.ones(3, 11), torch.Generator())


def test_accept_greedy_large_tree_fast_path():
    # 1024-node chain fully accepted
    toks = torch.arange(1024)
    t = DraftTree.chain(toks)
    am = torch.cat([toks[1:], torch.tensor([-5])])
    acc, bonus = accept_greedy(t, am)
    assert acc == list(range(1024)) and bonus == -5


@FUZZ
@given(tree=random_tree(max_nodes=40, vocab=3), data=st.data())
def test_accept_greedy_fuzz(tree, data):
    n = tree.num_nodes
    am = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="argmax")
    acc, bonus = accept_greedy(tree, torch.tensor(am))
    toks = tree.tokens.tolist()
    par = tree.parents.tolist()
    assert acc[0] == 0
    assert acc == tree.path(acc[-1])  # a valid root path
    for a, b in zip(acc[:-1], acc[1:], strict=True):
        assert par[b] == a
        assert toks[b] == am[a]
        # the first child in node order with that token
        assert b == min(c for c in tree.children(a) if toks[c] == am[a])
    last = acc[-1]
    assert bonus == am[last]
    assert all(toks[c] != bonus for c in tree.children(last))
    # sampling acceptance with one-hot target distributions is the greedy walk
    probs = torch.nn.functional.one_hot(torch.tensor(am), num_classes=4).float()
    assert accept_sampling(tree, probs, torch.Generator().manual_seed(0)) == (acc, bonus)


def test_accept_sampling_peaked_distribution():
    v = 50
    probs = torch.full((5, v), 1e-9)
    for node, tok in enumerate([5, 7, 0, 8, 42]):
        probs[node, tok] = 1.0
    g = torch.Generator().manual_seed(1234)
    for _ in range(20):
        assert accept_sampling(ACC_TREE, probs, g) == ([0, 1, 3, 4], 42)
    probs[0] = 0.0
    probs[0, 6] = 1.0  # root picks n2's token -> n2, whose distribution then commits token 3
    probs[2] = 0.0
    probs[2, 3] = 1.0
    assert accept_sampling(ACC_TREE, probs, g) == ([0, 2], 3)


def test_accept_sampling_is_lossless_on_two_steps():
    # root's children carry tokens 0 and 1 (not 2). Committed prefix distribution must be the target's:
    # P(0, x) = 0.5 * p_n1(x), P(1, x) = 0.3 * p_n2(x), P(2) = 0.2 (round ends after one token).
    tree = DraftTree.from_parents(torch.tensor([9, 0, 1]), torch.tensor([-1, 0, 0]))
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7], [0.6, 0.4, 0.0]])
    g = torch.Generator().manual_seed(7)
    trials = 6000
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(trials):
        acc, nxt = accept_sampling(tree, probs, g)
        committed = tuple(tree.tokens[acc[1:]].tolist()) + (nxt,)
        counts[committed] = counts.get(committed, 0) + 1
    expected = {(2,): 0.2}
    for x in range(3):
        expected[(0, x)] = 0.5 * float(probs[1, x])
        expected[(1, x)] = 0.3 * float(probs[2, x])
    assert set(counts) <= {k for k, p in expected.items() if p > 0}
    for key, p in expected.items():
        assert counts.get(key, 0) / trials == pytest.approx(p, abs=0.025), key


# --------------------------------------------------------------------------------------------------
# Branch-conditioned refinement: re-score on the own path, keep the best `budget`
# --------------------------------------------------------------------------------------------------


def test_rescore_and_select_hand_worked():
    # root(9) -> a(1) -> c(3) ; root -> b(2) -> d(4)
    tree = DraftTree.from_parents([9, 1, 2, 3, 4], [-1, 0, 0, 1, 2])
    lp = torch.full((5, 6), -10.0)
    lp[0, 1], lp[0, 2] = -2.0, -0.5  # the path-conditioned view prefers b over a
    lp[1, 3] = -0.1  # a -> c : -2.1
    lp[2, 4] = -1.0  # b -> d : -1.5
    out = rescore_and_select(tree, lp, budget=2)
    # scores: a -2.0, b -0.5, c -2.1, d -1.5 -> keep b, d (in candidate order: b before d)
    assert out.tokens.tolist() == [9, 2, 4]
    assert out.parents.tolist() == [-1, 0, 1]
    assert out.depths.tolist() == [0, 1, 2]
    assert out.scores.tolist() == pytest.approx([0.0, -0.5, -1.5])
    assert rescore_and_select(tree, lp, budget=0).tokens.tolist() == [9]
    assert rescore_and_select(tree, lp, budget=9).num_nodes == 5


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(0, 40), st.integers(0, 2**31 - 1))
def test_rescore_and_select_keeps_a_valid_best_subtree(n, budget, seed):
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tree = DraftTree.from_parents(torch.randint(0, 7, (n,), generator=g), parents)
    lp = torch.log_softmax(torch.randn(n, 7, generator=g), dim=-1)
    out = rescore_and_select(tree, lp, budget)
    out.validate()
    k = min(budget, n - 1)
    assert out.num_nodes == k + 1
    # reference: path-conditioned scores of every candidate, computed naively from the root
    ref = []
    for i in range(1, n):
        path = tree.path(i)
        ref.append(sum(float(lp[a, tree.tokens[b]]) for a, b in zip(path[:-1], path[1:], strict=True)))
    best = sorted(ref, reverse=True)[:k]
    assert sorted(out.scores[1:].tolist(), reverse=True) == pytest.approx(best, abs=1e-5)
