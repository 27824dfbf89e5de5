"""The KV-length dimension of a cost profile: a round is priced at the KV length it runs at.

The profiles here are hand-written from a known cost model (no timing), the one the module docstring
gives: seconds = a part that grows with the tree (compute) + a part linear in the KV length (reading the
cache, which a tree's rows share). Its ratios fall as the KV length grows, as measured on SmolLM2 (budget
16 at 16 requests: 7.3 AR steps at 64 positions, 5.2 at 256). Because that model is affine in the length,
the profile must reproduce it exactly at any length from its two measured points; anything else is a bug
in the reading, not a tolerance.
"""

from __future__ import annotations

import pytest

from jetflow_pl.decoding.budget import (
    LADDER_BUDGETS,
    AcceptanceProfile,
    AcceptanceStats,
    AutoBudget,
    RoundInfo,
    RoundResult,
)
from jetflow_pl.decoding.budget.cost_profile import LADDER_NODES, CostProfile, _at_kv
from jetflow_pl.errors import UserInputError
from jetflow_pl.tree import DraftTree

LONG, SHORT = 256, 64
BATCHES = (2, 8)


def seconds(n: int, kv: int, batch: int = 1) -> float:
    """The cost model: compute grows with the rows B x N (each node dearer the larger B, as on a CPU),
    the cache read with B x KV (not with N: a tree's rows share it)."""
    return 0.02 * batch * (1.0 + 0.15 * batch * (n - 1)) + 0.0004 * batch * kv


def draft_seconds(n: int, kv: int, batch: int = 1) -> float:
    return 0.0 if n == 1 else 0.01 * batch + 0.00002 * batch * kv


def model_profile(short: bool = True) -> CostProfile:
    def rows(kv: int) -> dict[str, list]:
        return {
            "verify_s": [seconds(n, kv) for n in LADDER_NODES],
            "build_s": [0.0 if n == 1 else 0.001 for n in LADDER_NODES],
            "draft_s": [draft_seconds(n, kv) for n in LADDER_NODES],
            "batch_verify_s": [[seconds(n, kv, b) for n in LADDER_NODES] for b in BATCHES],
            "batch_build_s": [[0.0 if n == 1 else 0.001 * b for n in LADDER_NODES] for b in BATCHES],
            "batch_draft_s": [[draft_seconds(n, kv, b) for n in LADDER_NODES] for b in BATCHES],
        }

    long = rows(LONG)
    return CostProfile(
        fingerprint={"machine": "synthetic"},
        nodes=list(LADDER_NODES),
        verify_s=long["verify_s"],
        build_s=long["build_s"],
        draft_s=long["draft_s"],
        kv_len=LONG,
        repeats=1,
        batch_sizes=list(BATCHES),
        batch_nodes=[list(LADDER_NODES) for _ in BATCHES],
        batch_verify_s=long["batch_verify_s"],
        batch_build_s=long["batch_build_s"],
        batch_draft_s=long["batch_draft_s"],
        short_kv={"kv_len": SHORT, **rows(SHORT)} if short else None,
    )


def true_cost(k: int, batch: int, kv: int) -> float:
    """A round at budget k in AR steps: 1 at k = 0 (no draft, no tree), else verify + draft + build."""
    n = k + 1
    if k == 0:
        return 1.0
    return (seconds(n, kv, batch) + draft_seconds(n, kv, batch) + 0.001 * batch) / seconds(1, kv, batch)


@pytest.mark.parametrize("batch", (1, 2, 8))
@pytest.mark.parametrize("kv", (16, 64, 100, 256, 1000))
def test_a_round_is_priced_at_its_own_kv_length(batch, kv):
    """Inside, below and above the two measured lengths the affine model is read back exactly (the
    model is affine, so exactness is what a correct reading gives; 1e-9 is float rounding)."""
    prof = model_profile()
    for k in (1, 4, 16, 64):
        assert prof.cost(k, batch, kv) == pytest.approx(true_cost(k, batch, kv), rel=1e-9)
    assert prof.ar_seconds(batch, kv) == pytest.approx(seconds(1, kv, batch), rel=1e-9)


def test_the_profile_s_own_length_and_no_length_read_the_first_measurement():
    prof = model_profile()
    for b in (1, 2, 8):
        for k in (1, 16):
            assert prof.cost(k, b) == prof.cost(k, b, LONG) == pytest.approx(true_cost(k, b, LONG))
    # the point of the dimension: a tree is dearer, in AR steps, on a shorter sequence
    assert prof.cost(16, 8, 64) > 1.3 * prof.cost(16, 8, 256)
    # a profile of one length prices every length as its own (files before version 4)
    one = model_profile(short=False)
    assert one.cost(16, 8, 64) == one.cost(16, 8) == prof.cost(16, 8)


def test_a_batch_size_not_measured_keeps_its_rule_at_every_kv_length():
    prof = model_profile()
    assert prof.cost(16, 5, 64) == prof.cost(16, 8, 64)  # between sizes: the larger one's costs
    assert prof.cost(16, 16, 64) == pytest.approx(2 * prof.cost(16, 8, 64))  # above: B / B_max times


def test_reading_at_a_length_keeps_larger_trees_dearer_and_never_goes_below_zero():
    # noise made the longer time the smaller one: that entry does not depend on the length
    assert _at_kv([2.0], [1.0], 64, 256, 10) == [1.5] and _at_kv([2.0], [1.0], 64, 256, 999) == [1.5]
    # a steep line extrapolated far below the short point stops at the line through the origin
    assert _at_kv([1.0], [10.0], 64, 256, 8) == [pytest.approx(1.0 * 8 / 64)]
    assert _at_kv([1.0], [1.6], 64, 256, 32) == [pytest.approx(0.9)]  # above that floor: the line itself
    # a size whose time grows faster with the length than the next size's: extrapolated far enough the
    # lines cross, and the profile keeps the larger tree at least as dear
    prof = model_profile()
    long, short = prof.verify_s, prof.short_kv["verify_s"]
    short[2] = long[2] - 0.5 * (long[2] - short[2])  # N = 3 grows half as fast as N = 2 with the length
    assert _at_kv(short[1:3], long[1:3], SHORT, LONG, 4000) == sorted(
        _at_kv(short[1:3], long[1:3], SHORT, LONG, 4000), reverse=True
    )  # crossed: read naively, budget 2 would be cheaper than budget 1 there
    for kv in (4000, 16000):
        costs = [prof.cost(k, 1, kv) for k in prof.budgets]
        assert costs == sorted(costs)


def test_a_malformed_second_length_is_one_clear_error():
    good = model_profile().to_dict()
    bad = dict(good, short_kv=dict(good["short_kv"], verify_s=good["short_kv"]["verify_s"][:3]))
    with pytest.raises(UserInputError, match="short_kv is malformed.*one time per tree size"):
        CostProfile(**bad)
    bad = dict(good, short_kv=dict(good["short_kv"], batch_draft_s=good["short_kv"]["batch_draft_s"][:1]))
    with pytest.raises(UserInputError, match="short_kv is malformed.*every measured batch size"):
        CostProfile(**bad)
    with pytest.raises(UserInputError, match="short_kv length must be in"):
        CostProfile(**dict(good, short_kv=dict(good["short_kv"], kv_len=LONG)))
    with pytest.raises(UserInputError, match="short_kv is malformed"):
        CostProfile(**dict(good, short_kv={"kv_len": SHORT}))
    zero = [0.0] * len(LADDER_NODES)
    with pytest.raises(UserInputError, match="short_kv times must be positive"):
        CostProfile(**dict(good, short_kv=dict(good["short_kv"], verify_s=zero)))
    # a negative batched draft time (a corrupt or hand-edited file) is refused too, not read as a discount
    negative = [[-x for x in row] for row in good["short_kv"]["batch_draft_s"]]
    with pytest.raises(UserInputError, match="short_kv times must be positive"):
        CostProfile(**dict(good, short_kv=dict(good["short_kv"], batch_draft_s=negative)))


def test_a_profile_with_two_lengths_survives_the_file_round_trip(tmp_path):
    prof = model_profile()
    again = CostProfile.load(prof.save(tmp_path / "p.json"))
    assert again == prof and again.cost(16, 8, 100) == prof.cost(16, 8, 100)


# ------------------------------------------------------------------------------------------ the chooser
#: acceptance of a head that pays for a small tree at 8 requests on long sequences only
TAU = {k: min(1.0 + 0.4 * (k + 1).bit_length(), 3.0) for k in LADDER_BUDGETS if k}


class FakeBackend:
    """Just what `AutoBudget.start` reads."""

    block_size = 16
    max_positions = 4096


def started() -> AutoBudget:
    ks = sorted(TAU)
    prior = AcceptanceProfile(budgets=ks, tau=[TAU[k] for k in ks], rounds=[100] * len(ks), width=4)
    pol = AutoBudget(model_profile(), prior, min_gain=1.05)
    pol.start(FakeBackend())
    return pol


def fresh(b: int) -> list[AcceptanceStats]:
    return [AcceptanceStats(LADDER_BUDGETS) for _ in range(b)]


def best_by_hand(batch: int, kv: int) -> int:
    """The rule written out on the true costs: the k of the best tau(k) / cost(k), 0 unless > 1.05."""
    best, speed = 0, 1.05
    for k, tau in sorted(TAU.items()):
        v = tau / true_cost(k, batch, kv)
        if v > speed:
            best, speed = k, v
    return best


def test_auto_drafts_on_long_sequences_and_plays_ar_on_short_ones_at_the_same_batch_size():
    pol = started()
    assert best_by_hand(8, 64) == 0 < best_by_hand(8, 1000)  # the case is the one the test is about
    for kv in (64, 1000):
        assert pol.choose(RoundInfo(fresh(8), None, kv)) == best_by_hand(8, kv)
        pol.observe(RoundResult([DraftTree.chain([5])] * 8, [[0]] * 8))
    assert pol._kv_len is None  # told for one round: a caller that tells nothing gets the profile's own
    assert pol.choose(RoundInfo(fresh(8))) == best_by_hand(8, LONG)


def test_the_clock_check_compares_a_round_with_the_profile_at_its_kv_length():
    """Rounds that took exactly what the model says at 64 positions: the clock finds the profile right
    there (no correction), where comparing them with the times at 256 would make trees look 1.3x
    dearer (their ratio is higher at 64) and lock `auto` into AR."""
    pol = started()
    for _ in range(3):
        for k in (0, 4):
            pol.choose(RoundInfo(fresh(8), None, SHORT))
            took = true_cost(k, 8, SHORT) * seconds(1, SHORT, 8)
            pol.observe(RoundResult([DraftTree.chain(list(range(k + 1)))] * 8, [[0]] * 8, seconds=took))
    pol.choose(RoundInfo(fresh(8), None, SHORT))
    assert pol.round_cost(4, 8) == pytest.approx(true_cost(4, 8, SHORT), rel=1e-9)
    report = pol.timing_report()["8"]
    assert report["0"]["observed_over_profiled"] == pytest.approx(1.0)
    assert report["4"]["observed_over_profiled"] == pytest.approx(1.0)
