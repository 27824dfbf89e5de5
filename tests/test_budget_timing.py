"""`auto` checks its cost profile against the clock (`AutoBudget(check_costs=True)`, the default).

A profile measured under one load and used under another can be wrong by 2x. These tests drive the policy
with round times from a known "true" cost (no real timing: the clock is the test's), so what they assert
is the correction rule: observed ratios replace profiled ones, AR check rounds are sparse when the profile
is right, a profile that is too cheap sends the policy to AR within a few rounds, times expire. The last
test runs the real decode loop on a backend whose tree verify really is slow.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import TINY_VOCAB
from synthetic_costs import batched_profile

from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
from jetflow_pl.decoding.budget import (
    LADDER_BUDGETS,
    AcceptanceProfile,
    AcceptanceStats,
    AutoBudget,
    RoundInfo,
    RoundResult,
)
from jetflow_pl.decoding.budget.cost_profile import CostProfile
from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel
from jetflow_pl.tree import DraftTree

MASK_ID = TINY_VOCAB - 1
EOS = 1
AR_SECONDS = 0.01
#: the head's acceptance: every simulated round accepts the first two drafts of a chain (when the tree
#: has them), so tau(1) = 2 and tau(k) = 3 from budget 2 on, consistent with the prefix property
TAU = {k: 2.0 if k < 2 else 3.0 for k in LADDER_BUDGETS if k}


def profile(slope: float, draft: float, batch: dict[int, float] | None = None) -> CostProfile:
    """t(1) = 1 s, t(N)/t(1) = 1 + slope (N - 1), the draft `draft` s; per B in `batch` the batched rows
    of `synthetic_costs.batched_profile`."""
    return batched_profile(batch or {}, slope, draft)


def prior(rounds: int = 100) -> AcceptanceProfile:
    ks = sorted(TAU)
    return AcceptanceProfile(budgets=ks, tau=[TAU[k] for k in ks], rounds=[rounds] * len(ks), width=4)


class FakeBackend:
    """Just what `AutoBudget.start` reads."""

    block_size = 16
    max_positions = 4096


def accepts_two(i: int, k: int) -> list[int]:
    """What the head's TAU says round `i` of a budget-`k` chain accepts: its first two drafts."""
    return list(range(min(3, k + 1)))


def run_rounds(pol: AutoBudget, true_cost, rounds: int, batch: int = 1, accepts=accepts_two) -> list[int]:
    """Play `rounds` rounds: the policy chooses, the round takes `true_cost(k) * AR_SECONDS` seconds on the
    test's clock and every request's chain tree accepts the node ids `accepts(round, k)`."""
    played = []
    for i in range(rounds):
        stats = [AcceptanceStats(LADDER_BUDGETS) for _ in range(batch)]
        k = pol.choose(RoundInfo(stats))
        played.append(k)
        trees = [DraftTree.chain(list(range(k + 1))) for _ in range(batch)]
        accepted = [accepts(i, k)] * batch
        pol.observe(RoundResult(trees, accepted, seconds=true_cost(k) * AR_SECONDS))
    return played


def started(pol: AutoBudget) -> AutoBudget:
    pol.start(FakeBackend())
    return pol


# ------------------------------------------------------------------------------------------ the rule
def test_observed_ratios_replace_the_profile_and_untimed_budgets_carry_its_error():
    cheap = profile(slope=0.01, draft=0.1)
    pol = started(AutoBudget(cheap, prior(), timing_samples=2))
    assert pol.round_cost(4) == pytest.approx(cheap.cost(4))  # nothing timed: the profile
    for _ in range(2):
        pol.observe_time(4, 1, 3.0 * AR_SECONDS)
    assert pol.round_cost(4) == pytest.approx(cheap.cost(4))  # no AR time yet: no ratio to take
    for seconds in (AR_SECONDS, 50 * AR_SECONDS):  # one slow outlier (a first call): the lower median
        pol.observe_time(0, 1, seconds)
    assert pol.round_cost(4) == pytest.approx(3.0)
    # a budget not timed carries the profile's error where it was timed (3.0 / cost(4) here)
    assert pol.round_cost(16) == pytest.approx(cheap.cost(16) * 3.0 / cheap.cost(4))
    assert pol.round_cost(0) == 1.0
    # other batch sizes keep their own (here: none) timing
    assert pol.round_cost(4, batch=2) == pytest.approx(cheap.cost(4, 2))
    off = started(AutoBudget(cheap, prior(), check_costs=False))
    for k, s in ((4, 3.0), (4, 3.0), (0, 1.0), (0, 1.0)):
        off.observe_time(k, 1, s * AR_SECONDS)
    assert off.round_cost(4) == pytest.approx(cheap.cost(4))


@pytest.mark.parametrize("probe_every", [10**6, 16], ids=["no-probes", "default-probes"])
def test_a_profile_too_cheap_sends_it_to_ar_within_a_few_rounds(probe_every):
    """The profile says a tree round costs ~1.1 AR steps (speculation pays 2.7x); it really costs 4 (tau
    3 / 4 < 1: AR is right). After two timed tree rounds and two AR checks it plays AR; what drafts after
    that are the session probes' (doubling intervals: at most log2(rounds / probe_every) + 1 of them)."""
    cheap = profile(slope=0.01, draft=0.1)
    pol = started(AutoBudget(cheap, prior(), probe_every=probe_every))
    played = run_rounds(pol, lambda k: 1.0 if k == 0 else 4.0, 400)
    assert played[:4] == [2, 2, 0, 0], played[:8]  # the profile's choice, timed twice; AR timed twice
    later = sum(1 for k in played[4:] if k)
    assert later <= (0 if probe_every > 400 else 1 + (400 // probe_every).bit_length()), played
    assert pol.round_cost(2) == pytest.approx(4.0)
    assert pol.best() == 0


def test_a_correct_profile_costs_only_sparse_ar_checks():
    """True costs equal the profile's: the choice never moves, and the AR check rounds back off (doubling
    from check_every), so they are O(log rounds)."""
    prof = profile(slope=0.05, draft=0.3)
    pol = started(AutoBudget(prof, prior(), explore_every=10**6, probe_every=10**6))
    best = pol.best()
    assert best > 0
    played = run_rounds(pol, lambda k: prof.cost(k), 600)
    ar = [i for i, k in enumerate(played) if k == 0]
    # 2 to learn AR's time, then checks at 16, 32, 64, ... rounds apart: 2 + log2(600 / 16) + 1 at most
    assert 2 <= len(ar) <= 8, ar
    assert {k for k in played if k} == {best}
    assert pol.round_cost(best) == pytest.approx(prof.cost(best))


def test_ar_checks_follow_load_that_changes_mid_session():
    """The profile is right at first; then a tree round gets 4x dearer (load on the cores speculation
    uses): the next check finds it and the policy moves to AR; when the load goes the times expire and
    it speculates again."""
    prof = profile(slope=0.05, draft=0.3)
    pol = started(
        AutoBudget(prof, prior(), explore_every=10**6, probe_every=10**6, check_every=8, max_check_every=64)
    )
    best = pol.best()
    run_rounds(pol, lambda k: prof.cost(k), 100)
    loaded = run_rounds(pol, lambda k: 1.0 if k == 0 else 4.0 * prof.cost(k), 200)
    assert loaded[-100:].count(0) >= 95, loaded
    quiet = run_rounds(pol, lambda k: prof.cost(k), 300)
    assert quiet[-100:].count(best) >= 90, quiet


def test_slow_ar_rounds_never_make_trees_cheaper_than_the_profile():
    """The clock ratio divides tree times by AR times taken at other moments. Here the profile is right
    (a budget-2 round costs 3.3 AR steps against tau 3: AR is the right choice), tree rounds (probes) are
    timed at their profile cost, then a spike makes 5 AR rounds 1.5x slow, then all is quiet again. Were
    the ratio allowed below 1, the spike's AR times against the quiet tree times would put budget 2 at
    3.3 / 1.5 = 2.2 AR steps (speed 1.36), the policy would speculate at a real 0.91x, and the window of AR
    times would only be flushed by AR check rounds whose intervals double (what happened on SmolLM2: 50
    rounds of budget 8 at 0.73x AR). The clock may only raise costs. (`probe_cost` 8 makes the probe
    budget 8, costing 6.3 AR steps: a budget whose round could pay were all 8 drafts accepted, so the
    schedule plays it; with the default the probe would be budget 2, which cannot pay even then and is
    never played.) Unpaired times may only raise costs; pairs (a tree round next to an AR round) move them
    both ways, and the spike's AR rounds are not next to quiet tree rounds often enough to outvote the
    quiet pairs (`test_pairs_*` below)."""
    prof = profile(slope=0.5, draft=1.3)  # cost(k) = 2.3 + k/2
    assert prof.cost(2) == pytest.approx(3.3)
    pol = started(AutoBudget(prof, prior(), explore_every=10**6, probe_every=4, probe_cost=8.0))
    assert pol.probe_budget() == 8
    assert pol.best() == 0
    run_rounds(pol, lambda k: prof.cost(k), 40)  # probes time trees at their profile cost
    timed = pol.timing_report()["1"]
    assert any(k != "0" for k in timed), timed
    spike = run_rounds(pol, lambda k: 1.5 if k == 0 else prof.cost(k), 5)
    assert spike.count(0) >= 4, spike  # AR rounds timed slow
    quiet = run_rounds(pol, lambda k: prof.cost(k), 200)
    for k in pol.candidates:
        assert pol.round_cost(k) >= prof.cost(k) - 1e-9, k
    # what drafts now is the probe schedule alone (intervals doubling from 4), never a chosen budget
    assert sum(1 for k in quiet if k) <= 1 + (245 // 4).bit_length(), quiet
    assert pol.best() == 0


# ------------------------------------------------------------------------------------------ explorations
def accepts_tau18(i: int, k: int) -> list[int]:
    """A head that accepts nothing in one round of five: tau(1) = 1.8, tau(k > 1) = 2.6."""
    return [0] if i % 5 == 0 else accepts_two(i, k)


def test_a_profile_that_is_right_keeps_explorations_from_moving_ar():
    """The profile puts budget 1 at 1.8 AR steps against tau 1.8: AR by a hair (speed 1.0 < min_gain).
    Where the rounds cost what the profile says, the explorations of budget 1 keep it at AR."""
    prof = profile(slope=0.8, draft=0.0)
    ks = [k for k in LADDER_BUDGETS if k]
    tau18 = AcceptanceProfile(
        budgets=ks, tau=[1.8 if k == 1 else 2.6 for k in ks], rounds=[100] * len(ks), width=4
    )
    pol = started(AutoBudget(prof, tau18, probe_every=10**6))
    assert pol.best() == 0
    played = run_rounds(pol, lambda k: prof.cost(k) if k else 1.0, 300, accepts=accepts_tau18)
    tail = played[-100:]
    assert sum(1 for k in tail if k) <= 5, played
    assert pol.round_cost(1) == pytest.approx(prof.cost(1))


def test_each_batch_size_is_checked_on_its_own():
    """Batch 4 is really dear (the profile put it at GPU-like costs), batch 1 is as profiled: auto goes to
    AR at 4 and keeps speculating alone."""
    prof = profile(slope=0.05, draft=0.3, batch={2: 0.005, 4: 0.005})
    pol = started(AutoBudget(prof, prior(), explore_every=10**6, probe_every=10**6))
    alone = pol.best()
    assert alone > 0 and pol.best_batch([AcceptanceStats(LADDER_BUDGETS) for _ in range(4)]) > 0
    at4 = run_rounds(pol, lambda k: 1.0 if k == 0 else 5.0, 60, batch=4)
    assert at4[-40:] == [0] * 40, at4
    at1 = run_rounds(pol, lambda k: prof.cost(k), 60)
    assert at1[-40:].count(alone) >= 38, at1


def test_bad_round_times_are_ignored():
    prof = profile(slope=0.05, draft=0.3)
    pol = started(AutoBudget(prof, prior()))
    for s in (float("nan"), float("inf"), 0.0, -1.0):
        pol.observe_time(4, 1, s)
        pol.observe_time(0, 1, s)
    assert pol._times == {}
    with pytest.raises(ValueError, match="timing_samples"):
        AutoBudget(prof, prior(), timing_samples=3, timing_window=2)


# ------------------------------------------------------------------------------------------ the decode loop
class SlowTreeBackend(TorchBackend):
    """A target whose verify of a tree (more than one node) takes 200 ms longer: a machine where the
    profile's cheap trees are not cheap. AR steps run at the real speed (~2 ms on the tiny target). The
    margin is 100x, so that AR rounds slowed 10x by a loaded CI machine (a descheduled thread) still time
    a tree round far above the profile's ~1.1 AR steps."""

    def verify_batch(self, slots, trees):
        if any(t.num_nodes > 1 for t in trees):
            time.sleep(0.2)
        return super().verify_batch(slots, trees)


@pytest.mark.usefixtures("one_thread")
def test_the_decode_loop_times_rounds_and_auto_goes_to_ar(tiny_target_dir):
    target = TargetModel.from_pretrained(tiny_target_dir)
    torch.manual_seed(0)
    cfg = DraftHeadConfig.for_target(target.config, num_hidden_layers=1, block_size=8, mask_token_id=MASK_ID)
    head = DraftHead(cfg).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, MASK_ID, (6,), generator=g).tolist() for _ in range(4)]
    ar = ARGenerator(TorchBackend(target), eos_token_id=EOS)
    refs = [ar.generate(p, 24).tokens for p in prompts]
    # the profile says trees are nearly free and the prior that the head is good: speculation would pay
    pol = AutoBudget(profile(slope=0.01, draft=0.05), prior(), probe_every=10**6)
    gen = SpeculativeGenerator(SlowTreeBackend(target, head), pol, width=3, eos_token_id=EOS)
    drafted = []
    for p, ref in zip(prompts, refs, strict=True):
        res = gen.generate(p, 24)
        assert res.tokens == ref  # lossless whatever the budget did
        drafted += [k for k in res.budgets if k]
    # 2 timed tree rounds, 2 AR checks, then AR: a 200 ms tree round is ~100 AR steps of the tiny target
    assert 2 <= len(drafted) <= 3, drafted
    assert pol.round_cost(drafted[0]) > 5.0
    assert "the profile's cost (clock" in pol.describe()


def test_a_draining_batch_learns_once_per_bucket():
    """Timed at 8 requests (tree rounds 5x AR, the profile said cheap), a batch draining to 7, 6, 5 (the
    same measured row, bucket 8) goes straight to AR; 4 requests is another bucket and learns anew."""
    prof = profile(slope=0.05, draft=0.3, batch={2: 0.005, 4: 0.005, 8: 0.005})
    pol = started(AutoBudget(prof, prior(), explore_every=10**6, probe_every=10**6))
    at8 = run_rounds(pol, lambda k: 1.0 if k == 0 else 5.0, 20, batch=8)
    assert at8[:4] == [at8[0], at8[0], 0, 0] and at8[0] > 0 and set(at8[4:]) == {0}, at8
    for b in (7, 6, 5):
        assert run_rounds(pol, lambda k: 1.0 if k == 0 else 5.0, 5, batch=b) == [0] * 5, b
    at4 = run_rounds(pol, lambda k: 1.0 if k == 0 else 5.0, 6, batch=4)
    assert at4[0] > 0, at4  # a bucket of its own: the profile again until timed


def test_timing_report_says_what_the_clock_saw():
    cheap = profile(slope=0.01, draft=0.1)
    pol = started(AutoBudget(cheap, prior()))
    run_rounds(pol, lambda k: 1.0 if k == 0 else 4.0, 6)
    report = pol.timing_report()["1"]
    assert report["0"]["rounds"] >= 2 and report["2"]["rounds"] >= 2
    assert report["2"]["cost_used"] == pytest.approx(4.0)
    assert report["2"]["cost_profiled"] == pytest.approx(cheap.cost(2))
