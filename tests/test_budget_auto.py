"""`budget="auto"`: the prefix property it learns from, the chooser on synthetic profiles, lossless decoding.

The chooser tests use hand-written cost and acceptance profiles (no timing), so what they assert is the
decision rule itself: AR when no budget can pay, the argmax of tau(k) / cost(k) otherwise.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB
from synthetic_costs import profile_of

from jetflow_pl.decoding import ARGenerator, SamplingConfig, SpeculativeGenerator
from jetflow_pl.decoding.budget import (
    LADDER_BUDGETS,
    AcceptanceProfile,
    AcceptanceStats,
    AutoBudget,
    FixedBudget,
    RoundInfo,
    RoundResult,
    accept_length_at,
    resolve_budget,
)
from jetflow_pl.decoding.budget.cost_profile import LADDER_NODES, CostProfile
from jetflow_pl.errors import UserInputError
from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel
from jetflow_pl.tree import SCORE_QUANTUM, DraftTree, Top2GapCap, accept_greedy, accept_sampling, build_tree

MASK_ID = TINY_VOCAB - 1
EOS = 1


# ------------------------------------------------------------------------------------------ helpers
def synthetic_cost(verify: dict[int, float], draft: float, build: float = 0.0) -> CostProfile:
    """A cost profile with t(1) = 1 s and the given verify t(N), a round with a draft paying `draft` and
    `build` on top (seconds = ratios)."""
    return profile_of({1: {n: t + (draft + build if n > 1 else 0.0) for n, t in verify.items()}})


def linear_cost(slope: float, draft: float) -> CostProfile:
    """t(N)/t(1) = 1 + slope * (N - 1) over the whole ladder."""
    return synthetic_cost({n: 1.0 + slope * (n - 1) for n in LADDER_NODES}, draft)


def prior_of(tau: dict[int, float], rounds: int = 100, width: int = 4) -> AcceptanceProfile:
    ks = sorted(tau)
    return AcceptanceProfile(budgets=ks, tau=[tau[k] for k in ks], rounds=[rounds] * len(ks), width=width)


class FakeBackend:
    """Just what `AutoBudget.start` reads: block size, context and tree limits."""

    def __init__(self, block_size: int = 16, max_positions: int = 4096, max_tree_nodes: int | None = None):
        self.block_size = block_size
        self.max_positions = max_positions
        if max_tree_nodes is not None:
            self.max_tree_nodes = max_tree_nodes


def started(policy: AutoBudget, backend=None) -> AutoBudget:
    policy.start(backend or FakeBackend())
    return policy


def brute_force_best(cost: CostProfile, tau: dict[int, float], min_gain: float) -> int:
    """The decision rule written out independently: the budget of the highest tau(k)/cost(k), 0 unless
    it beats AR by min_gain. tau is stepwise between listed budgets (as AcceptanceProfile.at)."""

    def at(k: int) -> float:
        listed = [b for b in sorted(tau) if b <= k]
        return tau[listed[-1]] if listed else 1.0

    best, best_speed = 0, min_gain
    for k in cost.budgets:
        if k and at(k) / cost.cost(k) > best_speed:
            best, best_speed = k, at(k) / cost.cost(k)
    return best


def play_chains(pol: AutoBudget, rounds: int, drafts_accepted) -> list[int]:
    """Play `rounds` rounds of `pol` on chain trees; round r accepts `drafts_accepted(r)` drafts (capped by
    the tree). Returns the budgets played."""
    played = []
    for r in range(rounds):
        k = pol.choose(RoundInfo())
        played.append(k)
        pol.observe(
            RoundResult([DraftTree.chain(list(range(k + 1)))], [list(range(min(k, drafts_accepted(r)) + 1))])
        )
    return played


def random_logprobs(seed: int, depths: int = 15, vocab: int = 50, peaked: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depths, vocab, generator=g) * (4.0 if peaked else 1.0)
    return torch.log_softmax(logits, dim=-1)


# ------------------------------------------------------------------------------------------ prefix property
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("width", "policy", "quantum"),
    [(4, None, SCORE_QUANTUM), (1, None, 0.0), (3, Top2GapCap(1.0), SCORE_QUANTUM), (8, None, 0.0)],
    ids=["w4-quantized", "chain", "gapcap", "w8"],
)
def test_first_k_plus_1_nodes_of_a_budget_K_tree_are_the_budget_k_tree(seed, width, policy, quantum):
    lp = random_logprobs(seed, peaked=seed % 2 == 0)
    big = build_tree(lp, 7, 256, width, policy, quantum)
    for k in range(0, big.budget + 1):
        small = build_tree(lp, 7, k, width, policy, quantum)
        n = small.num_nodes
        assert n == k + 1, (k, n)
        assert torch.equal(small.tokens, big.tokens[:n]), k
        assert torch.equal(small.parents, big.parents[:n]), k
        assert torch.equal(small.depths, big.depths[:n]), k
        assert torch.equal(small.scores, big.scores[:n]), k


@pytest.mark.parametrize("seed", range(8))
def test_accept_length_at_k_equals_the_walk_on_the_budget_k_tree(seed):
    """Greedy and sampling: the walk on the budget-k tree is the budget-K walk cut at node ids > k."""
    lp = random_logprobs(seed, vocab=6)  # small vocab: targets often agree with the draft
    big = build_tree(lp, 3, 64, 3, None, SCORE_QUANTUM)
    g = torch.Generator().manual_seed(100 + seed)
    # a "target" that follows the tree's best path with high probability: long accepted paths
    argmax = torch.where(torch.rand(big.num_nodes, generator=g) < 0.8, big.tokens.roll(-1), torch.tensor(5))
    probs = torch.softmax(torch.randn(big.num_nodes, 6, generator=g) * 3, dim=-1)
    full_greedy, _ = accept_greedy(big, argmax)
    full_sampled, _ = accept_sampling(big, probs, torch.Generator().manual_seed(seed))
    for k in range(big.budget + 1):
        small = build_tree(lp, 3, k, 3, None, SCORE_QUANTUM)
        acc, _ = accept_greedy(small, argmax[: small.num_nodes])
        assert len(acc) == accept_length_at(full_greedy, k), k
        acc, _ = accept_sampling(small, probs[: small.num_nodes], torch.Generator().manual_seed(seed))
        assert len(acc) == accept_length_at(full_sampled, k), k


def test_acceptance_stats_count_only_budgets_the_tree_covered():
    stats = AcceptanceStats((0, 1, 2, 4, 8))
    stats.observe([0, 1, 3, 6], tree_budget=4)  # a budget-4 round: budget 8 is not observed
    assert [stats.count(k) for k in (0, 1, 2, 4, 8)] == [1, 1, 1, 1, 0]
    assert [stats.mean(k) for k in (0, 1, 2, 4)] == [1.0, 2.0, 2.0, 3.0]
    assert stats.mean(8) is None
    prof = stats.to_profile(width=4)
    assert prof.budgets == [0, 1, 2, 4] and prof.at(3) == 2.0 and prof.at(100) == 3.0


# ------------------------------------------------------------------------------------------ chooser
def test_chooser_picks_ar_when_drafting_cannot_pay():
    # the toy world on a CPU: a draft costing one AR step, verify growing with N, a weak head
    cost = linear_cost(slope=0.05, draft=1.0)
    tau = {1: 1.3, 2: 1.5, 4: 1.7, 8: 1.9, 16: 2.0, 32: 2.1}
    pol = started(AutoBudget(cost, prior_of(tau)))
    assert brute_force_best(cost, tau, pol.min_gain) == 0
    assert pol.best() == 0
    assert all(v < 1.0 for k, v in pol.speeds().items() if k)
    # in play, with the observations agreeing (nothing accepted): AR, except for the session's probes,
    # which come at doubling intervals (16, 48, 112, 240) and are the only rounds that draft. A probe plays
    # the largest budget whose upper confidence bound (tau + 2 standard errors, variance at least 1/4)
    # could still pay: the probe budget (32) while nothing is known, then only budget 4 (after two probes
    # that accepted nothing, 8-32 cannot pay even on their bound), then 8, whose evidence aged since round
    # 48 (the bound widens with the rounds since a budget was seen)
    played = []
    for _ in range(300):
        k = pol.choose(RoundInfo())
        played.append(k)
        pol.observe(RoundResult([DraftTree.chain([5] * (k + 1))], [[0]]))
    probes = [i for i, k in enumerate(played) if k]
    assert probes == [16, 48, 112, 240], probes
    assert [played[i] for i in probes] == [pol.probe_budget(), pol.probe_budget(), 4, 8]
    # what exploring cost, in AR steps, over the whole session: a few percent, shrinking with its length
    extra = sum(cost.cost(played[i]) - 1.0 for i in probes)
    assert extra / len(played) < 0.05


@pytest.mark.parametrize(
    ("slope", "draft", "tau"),
    [
        (0.05, 0.3, {1: 1.7, 2: 2.2, 4: 2.8, 8: 3.3, 16: 3.7, 32: 3.9, 64: 4.0, 128: 4.05, 256: 4.1}),
        (0.002, 0.05, {1: 1.7, 2: 2.2, 4: 2.8, 8: 3.3, 16: 3.7, 32: 3.9, 64: 4.0, 128: 4.05, 256: 4.1}),
        (0.2, 0.1, {1: 1.9, 2: 2.5, 4: 2.9, 8: 3.0, 16: 3.0, 32: 3.0, 64: 3.0, 128: 3.0, 256: 3.0}),
    ],
    ids=["cpu-like", "gpu-like", "steep"],
)
def test_chooser_picks_the_argmax_of_tau_over_cost(slope, draft, tau):
    cost = linear_cost(slope, draft)
    pol = started(AutoBudget(cost, prior_of(tau)))
    expected = brute_force_best(cost, tau, pol.min_gain)
    assert expected != 0
    assert pol.best() == expected
    # the decision differs between the cost regimes: it is the cost model, not a constant
    assert pol.choose(RoundInfo()) == expected


def test_chooser_regimes_give_different_budgets():
    tau = {1: 1.7, 2: 2.2, 4: 2.8, 8: 3.3, 16: 3.7, 32: 3.9, 64: 4.0, 128: 4.05, 256: 4.1}
    cpu = started(AutoBudget(linear_cost(0.05, 0.3), prior_of(tau))).best()
    gpu = started(AutoBudget(linear_cost(0.002, 0.05), prior_of(tau))).best()
    assert gpu > cpu > 0


def test_min_gain_keeps_ar_when_the_gain_is_within_noise():
    cost = linear_cost(0.0, 0.0)  # free drafting: speed(k) = tau(k)
    pol = started(AutoBudget(cost, prior_of({k: 1.03 for k in LADDER_BUDGETS if k}), min_gain=1.05))
    assert pol.best() == 0
    pol = started(AutoBudget(cost, prior_of({k: 1.03 for k in LADDER_BUDGETS if k}), min_gain=1.0))
    assert pol.best() == 1  # ties go to the smaller (cheaper) budget


def test_candidates_are_capped_by_the_backend_limit_and_need_a_head():
    cost = linear_cost(0.0, 0.0)
    tau = {k: 1.0 + k for k in LADDER_BUDGETS if k}  # bigger always better
    pol = started(AutoBudget(cost, prior_of(tau)), FakeBackend(max_tree_nodes=33))
    assert max(pol.candidates) == 32 and pol.best() == 32
    pol = started(AutoBudget(cost, prior_of(tau)), FakeBackend(block_size=1))
    assert pol.candidates == [0] and pol.choose(RoundInfo()) == 0


def test_online_estimate_overrides_a_wrong_prior():
    """An optimistic prior says drafting pays; the rounds played accept nothing: within a few rounds
    (prior_weight pseudo-rounds per budget) the policy settles on AR."""
    cost = linear_cost(0.05, 0.3)
    optimistic = {k: min(1.0 + k, 4.0) for k in LADDER_BUDGETS if k}
    pol = started(AutoBudget(cost, prior_of(optimistic)))
    played = []
    for _ in range(120):
        k = pol.choose(RoundInfo())
        played.append(k)
        pol.observe(RoundResult([DraftTree.chain([1] * (k + 1))], [[0]]))
    assert played[0] > 0
    late = played[-60:]
    assert late.count(0) >= 55, played
    # AR, a cheap look one rung up, or a session probe (at most the probe budget)
    assert all(k <= max(1, pol.probe_budget()) for k in late), played


def test_probing_recovers_from_a_pessimistic_prior():
    """A prior from other data says the head is useless; on this data every round would accept 3 drafts.
    The first session probe measures it, and from then on the policy drafts."""
    cost = linear_cost(0.05, 0.3)
    pol = started(AutoBudget(cost, prior_of({k: 1.0 for k in LADDER_BUDGETS if k})))
    played = play_chains(pol, 80, lambda r: 3)
    assert played[:16] == [0] * 16 and played[16] == pol.probe_budget()
    assert all(k > 0 for k in played[17:]), played
    assert pol.best() == brute_force_best(cost, {1: 2.0, 2: 3.0, 4: 4.0}, pol.min_gain)


def test_without_prior_it_probes_then_learns_from_the_probe():
    cost = linear_cost(0.05, 0.3)
    pol = started(AutoBudget(cost, None, probe_rounds=2, probe_cost=4.0))
    probe = pol.probe_budget()
    assert probe == max(k for k in pol.candidates if k and cost.cost(k) <= 4.0)
    # every probe round accepts a chain of 3 drafts: tau(k) = min(1 + k, 4) for k <= probe
    for _ in range(2):
        assert pol.choose(RoundInfo()) == probe
        tree = DraftTree.chain(list(range(probe + 1)))
        pol.observe(RoundResult([tree], [[0, 1, 2, 3]]))
    tau = {k: min(1.0 + k, 4.0) for k in pol.candidates if k and k <= probe}
    assert pol.best() == brute_force_best(cost, tau, pol.min_gain) > 0


def test_exploration_revisits_the_next_budget_with_backoff():
    """The best budget is played; the next larger one (close in expected speed) is re-explored now and
    then, less often while exploring does not change the choice."""
    cost = linear_cost(0.01, 0.3)
    # every round accepts 2 drafts whatever the budget (k >= 2): tau(k) = min(1 + k, 3), as the prior says
    pol = AutoBudget(
        cost, prior_of({1: 2.0, 2: 3.0}), explore_every=4, max_explore_every=16, probe_every=10**6
    )
    started(pol)  # session probes off: this test is about the rung above
    best = pol.best()
    assert best == 2  # tau flat from 2 on, cost rising: the smallest budget reaching tau 3
    played = play_chains(pol, 120, lambda r: 2)
    up = 4
    explores = [i for i, k in enumerate(played) if k == up]
    assert set(played) == {best, up}
    assert len(explores) >= 4, explores
    gaps = [b - a for a, b in zip(explores, explores[1:], strict=False)]
    assert gaps[0] < gaps[-1] and max(gaps) == 16, gaps  # intervals double up to max_explore_every
    assert played.count(best) > 0.8 * len(played)


def test_resolve_budget_forms():
    assert isinstance(resolve_budget(16), FixedBudget) and resolve_budget(16).budget == 16
    assert isinstance(resolve_budget("auto"), AutoBudget)
    pol = AutoBudget(linear_cost(0.0, 0.0))
    assert resolve_budget(pol) is pol
    for bad in ("fast", -1, True, 2.5):
        with pytest.raises(UserInputError):
            resolve_budget(bad)


def test_acceptance_profile_roundtrip_and_bad_files(tmp_path):
    prof = prior_of({1: 1.5, 4: 2.5, 16: 3.5}, rounds=12)
    path = prof.save(tmp_path / "a.json")
    again = AcceptanceProfile.load(path)
    assert again.budgets == prof.budgets and again.tau == prof.tau and again.source == str(path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserInputError, match="bad.json is not readable"):
        AcceptanceProfile.load(tmp_path / "bad.json")
    (tmp_path / "imp.json").write_text(path.read_text().replace("3.5", "30.5"))
    with pytest.raises(UserInputError, match="outside"):
        AcceptanceProfile.load(tmp_path / "imp.json")


# ------------------------------------------------------------------------------------------ lossless decoding
def make_head(target: TargetModel, seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    cfg = DraftHeadConfig.for_target(target.config, num_hidden_layers=1, block_size=8, mask_token_id=MASK_ID)
    return DraftHead(cfg).eval()


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, MASK_ID, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


class CountingBackend(TorchBackend):
    """TorchBackend counting head drafts: budget 0 must mean no draft forward at all."""

    drafts = 0

    def draft_batch(self, slots, anchors, depths: int | None = None):
        self.drafts += 1
        return super().draft_batch(slots, anchors, depths)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    target = TargetModel.from_pretrained(tiny_target_dir)
    ar = ARGenerator(TorchBackend(target), eos_token_id=EOS)
    ps = prompts(8, seed=5)
    return target, ps, [ar.generate(p, 24).tokens for p in ps]


@pytest.mark.parametrize(
    "tau",
    [
        {k: min(1.0 + 0.5 * k, 3.0) for k in LADDER_BUDGETS if k},  # optimistic: drafts, then adapts
        {1: 1.2, 2: 1.4, 4: 2.0, 8: 2.4, 16: 2.6},  # mid: explores around a middle budget
    ],
    ids=["optimistic-prior", "mid-prior"],
)
def test_auto_greedy_output_is_identical_to_ar(tiny, tau):
    target, ps, refs = tiny
    # check_costs off: the synthetic profile (not this CPU's clock) is what makes it draft and explore
    pol = AutoBudget(
        linear_cost(0.01, 0.1),
        prior_of(tau, rounds=4),
        explore_every=1,
        explore_margin=0.9,
        check_costs=False,
    )
    gen = SpeculativeGenerator(TorchBackend(target, make_head(target)), pol, width=3, eos_token_id=EOS)
    played = set()
    for p, ref in zip(ps, refs, strict=True):
        res = gen.generate(p, 24)
        assert res.tokens == ref
        assert len(res.budgets) == len(res.accept_lengths) == res.num_rounds
        played |= set(res.budgets)
    assert len(played) >= 2, played  # the budget really changed between rounds


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: significance 0.001)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * a**0.5) ** 3


@pytest.mark.slow  # 1200 sampled generations: minutes on a loaded 2-core machine
def test_auto_sampling_matches_the_ar_distribution(tiny):
    """Chi-square homogeneity of (token 2, token 3, token 4) under sampling: auto (whose budget in a
    round depends on what earlier rounds accepted) vs AR, independent seeds. Lossless means the same
    distribution; a significance of 0.001 keeps the false-alarm rate negligible."""
    target, ps, _ = tiny
    prompt = ps[2]
    prior = prior_of({1: 1.6, 2: 2.0, 4: 2.4, 8: 2.6}, rounds=2)
    pol = AutoBudget(linear_cost(0.01, 0.1), prior, explore_every=1, explore_margin=0.9, check_costs=False)
    spec = SpeculativeGenerator(TorchBackend(target, make_head(target)), pol, width=3)
    ar = ARGenerator(TorchBackend(target))
    n, played = 600, set()
    counts_spec: dict[tuple[int, ...], int] = {}
    counts_ar: dict[tuple[int, ...], int] = {}
    for s in range(n):
        for gen, counts, seed in ((spec, counts_spec, s), (ar, counts_ar, n + s)):
            res = gen.generate(prompt, 4, SamplingConfig(temperature=1.0, top_k=3, seed=seed))
            key = tuple(res.tokens[1:4])
            counts[key] = counts.get(key, 0) + 1
            if gen is spec:
                played |= set(res.budgets)
    assert len(played) >= 2, played
    keys = sorted(set(counts_spec) | set(counts_ar))
    assert len(keys) > 4  # a real distribution, not a near-deterministic one
    stat = sum(
        (counts_spec.get(k, 0) - counts_ar.get(k, 0)) ** 2 / (counts_spec.get(k, 0) + counts_ar.get(k, 0))
        for k in keys
    )
    assert stat < chi2_critical(len(keys) - 1), (stat, counts_spec, counts_ar)


def test_recorded_acceptance_counts_the_rounds_played_after_it_starts(tiny):
    """The session's acceptance (an acceptance profile's data) is a round observer the caller asks for:
    rounds before it are not in it, every round after it is, at every ladder budget the tree covered; a
    refined tree is no prefix tree, so a refining generator records nothing."""
    target, ps, refs = tiny
    gen = SpeculativeGenerator(TorchBackend(target, make_head(target)), 4, eos_token_id=EOS)
    gen.generate(ps[0], 8)  # before recording: not counted
    stats = gen.record_acceptance()
    assert stats.budgets == tuple(k for k in LADDER_BUDGETS if k <= gen.max_budget)
    res = gen.generate(ps[1], 24)
    assert res.tokens == refs[1] and set(res.budgets) == {4}
    assert stats.count(4) == res.num_rounds and stats.count(8) == 0
    assert stats.mean(4) == pytest.approx(res.tau)
    refining = SpeculativeGenerator(
        TorchBackend(target, make_head(target)), 4, refine_factor=2, eos_token_id=EOS
    )
    nothing = refining.record_acceptance()
    assert refining.generate(ps[1], 24).tokens == refs[1] and not any(nothing.counts)


def test_auto_falls_back_to_ar_without_a_single_draft_forward(tiny):
    target, ps, refs = tiny
    useless = prior_of({k: 1.0 for k in LADDER_BUDGETS if k})
    for probe_every, max_probes in ((10**6, 0), (16, 4)):  # session probes off, then the default schedule
        backend = CountingBackend(target, make_head(target))
        # check_costs off: the synthetic profile is the scenario (drafting never pays); with the clock on,
        # this CPU's real round times would replace it and exploration would follow them instead
        pol = AutoBudget(linear_cost(0.05, 1.0), useless, probe_every=probe_every, check_costs=False)
        gen = SpeculativeGenerator(backend, pol, eos_token_id=EOS)
        drafted = 0
        for p, ref in zip(ps, refs, strict=True):
            res = gen.generate(p, 24)
            assert res.tokens == ref
            drafted += sum(1 for k in res.budgets if k)
        # a budget-0 round runs no head forward at all: the only drafts are the probes
        assert backend.drafts == drafted <= max_probes


def test_auto_with_the_string_measures_and_caches_a_profile(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("JETFLOW_PL_CACHE_DIR", str(tmp_path))
    target, ps, refs = tiny
    gen = SpeculativeGenerator(TorchBackend(target, make_head(target)), "auto", eos_token_id=EOS)
    assert gen.generate(ps[0], 24).tokens == refs[0]
    cached = list((tmp_path / "cost_profiles").glob("*.json"))
    assert len(cached) == 1
    prof = CostProfile.load(cached[0])
    assert prof.nodes[0][0] == 1 and prof.cost(0) == 1.0
    assert gen.budget_policy.cost.nodes == prof.nodes


def test_auto_refuses_refinement(tiny):
    target, _, _ = tiny
    with pytest.raises(UserInputError, match="refine_factor needs a fixed budget"):
        SpeculativeGenerator(TorchBackend(target, make_head(target)), "auto", refine_factor=2)


def test_a_session_probes_once_then_learns_across_generations():
    cost = linear_cost(0.05, 0.3)
    pol = started(AutoBudget(cost, None))
    probe = pol.probe_budget()
    for _ in range(6):  # every round accepts 2 drafts: tau(k) = min(1 + k, 3)
        k = pol.choose(RoundInfo())
        pol.observe(RoundResult([DraftTree.chain(list(range(k + 1)))], [list(range(min(k, 2) + 1))]))
    best = pol.best()
    assert best == brute_force_best(cost, {1: 2.0, 2: 3.0}, pol.min_gain) != probe
    pol.start(FakeBackend())  # the next generation: no probing, the session's rounds already tell
    assert pol.stats.mean(2) == pytest.approx(3.0) and pol.stats.count(2) == 6
    assert pol.choose(RoundInfo()) == best
    frozen = started(AutoBudget(cost, None, learn=False))
    frozen.choose(RoundInfo())
    frozen.observe(RoundResult([DraftTree.chain([0, 1, 2])], [[0, 1, 2]]))
    frozen.start(FakeBackend())
    assert frozen.stats.count(2) == 0 and frozen.choose(RoundInfo()) == frozen.probe_budget()


def test_memory_fades_old_rounds_so_the_estimate_follows_the_data():
    """64 rounds accepting nothing, then 64 accepting 3 drafts: with memory 16 the estimate follows the
    recent rounds, not the average of all 128."""
    pol = started(AutoBudget(linear_cost(0.05, 0.3), None, memory=16, probe_rounds=0))
    for accepted in ([0],) * 64 + ([0, 1, 2, 3],) * 64:
        pol.observe(RoundResult([DraftTree.chain(list(range(9)))], [accepted]))
    assert pol.stats.count(8) == 16
    assert pol.stats.mean(8) > 3.5  # the last rounds dominate (the plain average would be 2.5)


def test_promising_probes_repeat_until_a_modest_gain_overturns_the_prior():
    """A pessimistic prior, and data where drafting wins only ~1.4x (a draft costing one AR step): one
    probe is not enough evidence, so probes that beat the choice are repeated at once, and the policy
    is drafting a few rounds after the first probe instead of after a doubling schedule."""
    cost = linear_cost(0.05, 1.0)
    pol = started(AutoBudget(cost, prior_of({k: 1.0 for k in LADDER_BUDGETS if k}, rounds=100)))
    played = play_chains(pol, 60, lambda r: 2)
    first = played.index(pol.probe_budget())
    assert first == 16
    switched = next(i for i in range(first, len(played)) if 0 < played[i] != pol.probe_budget())
    assert switched - first <= 6, played
    assert all(k > 0 for k in played[switched:])
    assert pol.best() == brute_force_best(cost, {1: 2.0, 2: 3.0}, pol.min_gain)


def test_an_easy_stretch_does_not_make_larger_budgets_look_better():
    """Text alternates between easy stretches (16 rounds in which every tree accepts 2 drafts) and hard
    ones (1 draft accepted). Larger trees gain nothing in either: budgets above 2 never pay. Budgets above
    the choice are observed only in the rounds that probe or explore them; one that lands in an easy
    stretch must not make them look better than budget 2 (their own mean beats budget 2's mean over all
    rounds, their gain on the same rounds is 0), nor be repeated as promising. So budgets >= 4 are played
    only on the schedules: at most 6 session probes (every 16 rounds, doubling) and 11 looks one rung up
    (every 4 rounds, doubling to 64) in 512 rounds. (Comparing unpaired means, the policy moved to budget 4
    for whole stretches after such a probe: 39 rounds.)"""
    cost = linear_cost(0.05, 0.3)
    pol = started(AutoBudget(cost, prior_of({1: 2.0, 2: 2.5}), check_costs=False))
    assert pol.best() == 2
    # the first session probe (round 16) falls in an easy stretch
    played = play_chains(pol, 512, lambda r: 2 if (r // 16) % 2 == 1 else 1)
    assert played.count(pol.probe_budget()) <= 6, played
    assert sum(k >= 4 for k in played) <= 6 + 11, played


def test_a_probe_where_larger_trees_win_on_the_same_round_is_repeated():
    """The paired rule still sees real evidence: budget 2 is the choice, but in this stretch every round
    accepts 6 drafts, which only a larger tree can hold: a probe there beats budget 2 on the same round,
    so the next round probes again and the choice moves up within a few rounds."""
    cost = linear_cost(0.05, 0.3)
    pol = started(AutoBudget(cost, prior_of({1: 1.5, 2: 2.0}, rounds=100), check_costs=False))
    assert pol.best() == 2
    played = play_chains(pol, 40, lambda r: 6)
    first = played.index(pol.probe_budget())
    assert played[first + 1] == pol.probe_budget() or pol.best() > 2, played
    assert pol.best() > 2, played
