"""The ablation's per-round metrics (bench/decode.py): rank-1 branch faithfulness, the greedy branch, the
per-round recorder inside the real decode loop, and the prompt-level bootstrap."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from bench.decode import (
    RoundRecorder,
    accepted_prefix,
    best_leaf_branch,
    bootstrap_interval,
    branch_accepted,
    domain_prompts,
    greedy_branch,
    load_target,
)
from jetflow_pl.tree import DraftTree, accept_greedy, build_tree

REPO = Path(__file__).resolve().parents[1]


def _hand_tree() -> DraftTree:
    """root 0 -> {1 (-0.1), 2 (-1.0)}; 1 -> {3 (-0.3), 4 (-0.9)}; 3 -> {5 (-1.5)}; 2 -> {6 (-1.2)}.

    Leaves: 4 (-0.9), 5 (-1.5), 6 (-1.2): the rank-1 branch ends at 4 (the highest-scoring LEAF, although
    the deeper chain 0-1-3-5 is what the greedy descent follows)."""
    return DraftTree.from_parents(
        tokens=[10, 11, 12, 13, 14, 15, 16],
        parents=[-1, 0, 0, 1, 1, 3, 2],
        scores=[0.0, -0.1, -1.0, -0.3, -0.9, -1.5, -1.2],
    )


def test_best_leaf_and_greedy_branch_on_a_hand_built_tree() -> None:
    tree = _hand_tree()
    assert best_leaf_branch(tree) == [0, 1, 4]
    assert greedy_branch(tree) == [0, 1, 3, 5]


def test_faithfulness_follows_the_target_acceptance() -> None:
    tree = _hand_tree()
    # target argmax per node: at the root 11 (-> node 1), at node 1 14 (-> node 4), at node 4 anything
    accepted, bonus = accept_greedy(tree, torch.tensor([11, 14, 0, 0, 7, 0, 0]))
    assert accepted == [0, 1, 4] and bonus == 7
    assert branch_accepted(best_leaf_branch(tree), accepted)
    assert not branch_accepted(greedy_branch(tree), accepted)
    assert accepted_prefix(best_leaf_branch(tree), accepted) == 2
    # the target takes node 3 instead: the greedy chain is accepted up to 3 only, neither branch in full
    accepted, _ = accept_greedy(tree, torch.tensor([11, 13, 0, 99, 0, 0, 0]))
    assert accepted == [0, 1, 3]
    assert not branch_accepted(best_leaf_branch(tree), accepted)
    assert not branch_accepted(greedy_branch(tree), accepted)
    assert accepted_prefix(best_leaf_branch(tree), accepted) == 1  # node 1 yes, node 4 no
    assert accepted_prefix(greedy_branch(tree), accepted) == 2
    # nothing accepted
    assert accepted_prefix(greedy_branch(tree), [0]) == 0
    # the whole greedy chain accepted
    accepted, _ = accept_greedy(tree, torch.tensor([11, 13, 0, 15, 0, 0, 0]))
    assert branch_accepted(greedy_branch(tree), accepted)
    assert not branch_accepted(best_leaf_branch(tree), accepted)


def test_ties_go_to_the_node_inserted_first() -> None:
    # two leaves with the same score: node 1 (inserted first) wins, as build_tree breaks ties
    tree = DraftTree.from_parents(tokens=[0, 5, 6], parents=[-1, 0, 0], scores=[0.0, -0.5, -0.5])
    assert best_leaf_branch(tree) == [0, 1]
    assert greedy_branch(tree) == [0, 1]
    assert best_leaf_branch(DraftTree.chain([3])) == [0]


def test_branches_of_a_built_tree_are_root_to_leaf_paths() -> None:
    gen = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(6, 50, generator=gen) * 3, dim=-1)
    tree = build_tree(lp, root_token=1, budget=40, width=3)
    children = {int(p) for p in tree.parents.tolist()[1:]}
    for branch in (best_leaf_branch(tree), greedy_branch(tree)):
        assert branch[0] == 0 and branch[-1] not in children  # starts at the root, ends at a leaf
        assert tree.path(branch[-1]) == branch
    leaves = [i for i in range(1, tree.num_nodes) if i not in children]
    best = best_leaf_branch(tree)[-1]
    assert float(tree.scores[best]) == max(float(tree.scores[i]) for i in leaves)
    # the greedy branch takes the per-depth argmax token at every depth it reaches
    g = greedy_branch(tree)
    assert tree.tokens[g[1:]].tolist() == lp[: len(g) - 1].argmax(dim=-1).tolist()


def test_recorder_sees_every_round_of_a_real_decode() -> None:
    """The shipped small target and head: the recorder's accept lengths are the generator's, and a
    faithful rank-1 branch means the round accepted exactly that many drafts."""
    from jetflow_pl.checkpoints import load_draft_head
    from jetflow_pl.decoding import SpeculativeGenerator
    from jetflow_pl.runtime.loader import load_backend

    assets = REPO / "data_gen/toy/assets"
    tokenizer, target = load_target(assets / "small")
    backend = load_backend("torch", target=target, head=load_draft_head(assets / "small_head"))
    recorder = RoundRecorder()
    gen = SpeculativeGenerator(backend, 16, 4, eos_token_id=tokenizer.eos_token_id, observers=[recorder])
    result = gen.generate(domain_prompts(tokenizer, "math", 1)[0], 32)
    assert [r["accept_length"] for r in recorder.rounds] == result.accept_lengths
    for r in recorder.rounds:
        assert 0 <= r["rank1_accepted"] <= min(r["rank1_depth"], r["accept_length"] - 1)
        assert r["rank1_faithful"] == (r["rank1_accepted"] == r["rank1_depth"])
        if r["rank1_faithful"]:
            assert r["accept_length"] - 1 == r["rank1_depth"]
        if r["greedy_faithful"]:
            assert r["accept_length"] - 1 == r["greedy_depth"]
        assert 1 <= r["rank1_depth"] <= 15 and 1 <= r["greedy_depth"] <= 15


def test_bootstrap_interval_brackets_the_mean_and_narrows_with_more_items() -> None:
    gen = torch.Generator().manual_seed(1)
    small = torch.randn(20, generator=gen).tolist()
    large = torch.randn(400, generator=gen).tolist()
    lo_s, hi_s = bootstrap_interval(lambda idx: statistics.fmean(small[i] for i in idx), len(small))
    lo_l, hi_l = bootstrap_interval(lambda idx: statistics.fmean(large[i] for i in idx), len(large))
    assert lo_s < statistics.fmean(small) < hi_s
    assert lo_l < statistics.fmean(large) < hi_l
    # the standard error shrinks as 1/sqrt(n): 20x the items, ~4.5x narrower; 2x is a loose floor
    assert (hi_l - lo_l) * 2 < hi_s - lo_s
    # deterministic (seeded)
    assert bootstrap_interval(lambda idx: sum(idx), 10) == bootstrap_interval(lambda idx: sum(idx), 10)
    with pytest.raises(ValueError):
        bootstrap_interval(lambda idx: 0.0, 0)


def test_paired_bootstrap_of_identical_heads_is_exactly_one() -> None:
    """A paired ratio reads both heads at the same resampled prompts: identical heads give ratio 1 in
    every resample (an unpaired bootstrap would spread around 1)."""
    taus = [1.0 + 0.1 * i for i in range(30)]

    def ratio(idx):
        return sum(taus[i] for i in idx) / sum(taus[i] for i in idx)

    assert bootstrap_interval(ratio, len(taus)) == (1.0, 1.0)
