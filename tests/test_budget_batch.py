"""The batch-aware `budget="auto"`: the batch dimension of the cost profile, the shared budget of a batched
round, and lossless continuous batching with it.

The chooser tests use hand-written cost profiles (no timing): what they assert is the decision rule at
batch B, sum_i tau_i(k) / (B * cost(k, B)) against AR, with the costs of a CPU (a batched verify of B x N
rows costs a lot more than B AR steps) and of a GPU (it costs about the same). The profile tests measure
on the tiny random target with a tiny ladder and assert the structure, never the times.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_VOCAB
from synthetic_costs import batched_profile as profile

from data_gen.toy import SMALL_HEAD_DIR, SMALL_TARGET_DIR, heldout_prompts
from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
from jetflow_pl.decoding.budget import (
    LADDER_BUDGETS,
    AcceptanceProfile,
    AcceptanceStats,
    AutoBudget,
    RoundInfo,
    RoundResult,
)
from jetflow_pl.decoding.budget.cost_profile import (
    PROFILE_VERSION,
    CostProfile,
    CostProfileMismatch,
    cache_file,
    fingerprint,
)
from jetflow_pl.decoding.budget.measure_costs import batch_sizes_for, cost_profile_for, measure_cost_profile
from jetflow_pl.errors import UserInputError
from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel
from jetflow_pl.tree import DraftTree

EOS = 1
SMALL_LADDER = (1, 2, 5, 17)
BATCHES = (2, 4, 8)


# ------------------------------------------------------------------------------------------ helpers
#: a CPU: the batched verify turns compute-bound, each extra tree node costs more the larger the batch
CPU = profile({2: 0.1, 4: 0.25, 8: 1.0})
#: a GPU: a verify of B x N rows costs about what B AR steps cost, at every batch size measured
GPU = profile({2: 0.005, 4: 0.006, 8: 0.008}, slope=0.005)

#: the head's acceptance on this data: tau(k) = 1 + 0.5 bit_length(k + 1), at most 3.5
TAU = {k: min(1.0 + 0.5 * (k + 1).bit_length(), 3.5) for k in LADDER_BUDGETS if k}


def prior(tau: dict[int, float] = TAU, rounds: int = 100) -> AcceptanceProfile:
    ks = sorted(tau)
    return AcceptanceProfile(budgets=ks, tau=[tau[k] for k in ks], rounds=[rounds] * len(ks), width=4)


class FakeBackend:
    """Just what `AutoBudget.start` reads."""

    block_size = 16
    max_positions = 4096


def started(policy: AutoBudget) -> AutoBudget:
    policy.start(FakeBackend())
    return policy


def fresh(b: int) -> list[AcceptanceStats]:
    """`b` requests that have played no round yet."""
    return [AcceptanceStats(LADDER_BUDGETS) for _ in range(b)]


def brute_force(cost: CostProfile, taus: list[dict[int, float]], b: int, min_gain: float) -> int:
    """The rule written out independently: the k of the highest sum_i tau_i(k) / (b cost(k, b)), 0 unless
    it beats AR (speed 1) by min_gain."""
    best, best_speed = 0, min_gain
    for k in cost.budgets_at(b):
        if k:
            v = sum(t[k] for t in taus) / (b * cost.cost(k, b))
            if v > best_speed:
                best, best_speed = k, v
    return best


def monotone(tau: dict[int, float]) -> dict[int, float]:
    out, top = {}, 1.0
    for k in sorted(tau):
        top = max(top, tau[k])
        out[k] = top
    return out


# ------------------------------------------------------------------------------------------ the cost at B
def test_cost_at_batch_size_uses_the_measured_row_or_errs_toward_ar():
    cpu = CPU
    for b, slope in ((2, 0.1), (4, 0.25), (8, 1.0)):
        # measured B: (t(B, k+1) + draft(B)) / t(B, 1)
        assert cpu.cost(16, b) == pytest.approx(1 + slope * 16 + 0.2)
    assert cpu.cost(0, 8) == 1.0 and cpu.cost(16, 1) == pytest.approx(1 + 0.02 * 16 + 0.2)
    assert cpu.cost(16, 3) == cpu.cost(16, 4)  # between measured sizes: the larger one's (dearer) costs
    assert cpu.cost(16, 16) == pytest.approx(2 * cpu.cost(16, 8))  # above: bounded by B / B_max times
    no_batch = profile({})
    assert no_batch.cost(16, 4) == pytest.approx(4 * no_batch.cost(16, 1))  # batch 1 alone: B times
    assert cpu.batch_ar_ratio(8) == pytest.approx(4.0) and cpu.batch_ar_ratio(3) is None
    short = profile({4: 0.25})
    short.nodes[1] = short.nodes[1][:4]  # the ladder at B = 4 stopped at N = 5
    short.round_s[1] = short.round_s[1][:4]
    assert short.budgets_at(4) == [0, 1, 2, 4]
    with pytest.raises(ValueError, match="not measured at batch 4"):
        short.cost(16, 4)


def test_inconsistent_batch_rows_are_one_clear_error():
    good = CPU.to_dict()
    bad = dict(good, batch_sizes=[1, 4, 2, 8])
    with pytest.raises(UserInputError, match="batch sizes must start at 1 and increase"):
        CostProfile(**bad)
    bad = dict(good, batch_sizes=[2, 4, 8, 16])
    with pytest.raises(UserInputError, match="batch sizes must start at 1 and increase"):
        CostProfile(**bad)
    bad = dict(good, round_s=good["round_s"][:2])
    with pytest.raises(UserInputError, match="per batch size"):
        CostProfile(**bad)
    bad = json.loads(json.dumps(good))
    bad["nodes"][2] = [2, 3]
    with pytest.raises(UserInputError, match="at batch 4 must start at N = 1"):
        CostProfile(**bad)
    bad = json.loads(json.dumps(good))
    bad["round_s"][2] = bad["round_s"][2][:3]
    with pytest.raises(UserInputError, match="at batch 4: one round time per tree size"):
        CostProfile(**bad)
    bad = json.loads(json.dumps(good))
    bad["round_s"][1][0] = 0.0
    with pytest.raises(UserInputError, match="at batch 2 must be positive"):
        CostProfile(**bad)


# ------------------------------------------------------------------------------------------ the chooser
def test_expensive_batched_verify_plays_ar_at_large_batch_and_drafts_alone():
    pol = started(AutoBudget(CPU, prior()))
    alone = pol.choose(RoundInfo())
    assert alone > 0 and alone == pol.best()
    picks = {b: pol.best_batch(fresh(b)) for b in BATCHES}
    assert picks[8] == 0  # no budget pays: plain AR rounds inside the batch
    for b in BATCHES:  # the rule, with every request at the session estimate (no round of its own yet)
        assert picks[b] == brute_force(CPU, [monotone(TAU)] * b, b, pol.min_gain)
    assert picks[2] > 0 and picks[2] <= alone  # a batch of 2 still drafts, a smaller tree
    # what `_round` calls: a batch of one is `choose()` (the batch-1 policy), a batch of 8 the shared rule
    assert pol.choose(RoundInfo(fresh(1))) == alone
    assert pol.choose(RoundInfo(fresh(8))) == 0


def test_cheap_batched_verify_keeps_speculating_at_every_batch_size():
    pol = started(AutoBudget(GPU, prior()))
    alone = pol.best()
    for b in BATCHES:
        k = pol.best_batch(fresh(b))
        assert k == brute_force(GPU, [monotone(TAU)] * b, b, pol.min_gain) > 0
        assert pol.batch_speeds(fresh(b))[k] > 2.0  # far from the AR fallback
    assert alone > 0


def test_each_requests_own_acceptance_moves_the_shared_budget():
    """The same session estimate, but requests whose own rounds accepted everything buy a larger tree
    than requests whose rounds accepted nothing (the estimate per request is shrunk, not replaced)."""
    pol = started(AutoBudget(GPU, prior(), request_weight=4.0))
    easy, hard = fresh(4), fresh(4)
    for _ in range(40):
        for st in easy:
            st.observe(list(range(16)), 64)  # 15 accepted along the path: tau(k) = min(k, 15) + 1
        for st in hard:
            st.observe([0], 64)  # nothing accepted: tau(k) = 1
    k_easy, k_hard = pol.best_batch(easy), pol.best_batch(hard)
    assert k_easy > k_hard
    assert k_hard == 0  # 40 rounds of nothing outweigh 4 pseudo-rounds of the prior: AR
    # the shrinkage by hand for one request and one budget: (w * session + n * own) / (w + n)
    session = pol.estimates()
    est = pol.request_estimates(easy[0], session)
    assert est[8] == pytest.approx((4 * session[8] + 40 * 9.0) / 44)
    # above the largest budget it observed (64): its own tau(64) plus the session's increment
    hard_est = pol.request_estimates(hard[0], session)
    assert hard_est[128] == pytest.approx(hard_est[64] + session[128] - session[64])
    assert hard_est[128] < 1.25 < session[128]  # (4 * 3.5 + 40 * 1) / 44 = 1.23, not the prior 3.5


def test_a_batch_round_is_one_round_of_the_schedule_and_feeds_the_session_estimate():
    pol = started(AutoBudget(GPU, prior(rounds=2)))
    reqs = fresh(4)
    k = pol.choose(RoundInfo(reqs))
    assert k > 0
    trees = [DraftTree.chain(list(range(k + 1))) for _ in reqs]
    pol.observe(RoundResult(trees, [[0, 1, 2]] * 4))  # every request accepted two drafts
    assert pol._session_round == 1 and pol._round == 1  # one round, not four
    assert pol.stats.count(k) == 4 and pol.stats.mean(k) == pytest.approx(3.0)  # four requests' rounds


def test_without_prior_a_batch_probes_at_its_own_cost_then_learns():
    pol = started(AutoBudget(CPU, None))
    probe = pol.probe_budget(4)
    assert 0 < probe < pol.probe_budget(1)  # a probe costs at most `probe_cost` batched AR steps
    assert CPU.cost(probe, 4) <= pol.probe_cost
    reqs = fresh(4)
    assert pol.choose(RoundInfo(reqs)) == probe
    trees = [DraftTree.chain(list(range(probe + 1))) for _ in reqs]
    pol.observe(RoundResult(trees, [list(range(probe + 1))] * 4))  # everything accepted: drafting pays here
    assert pol.best_batch(reqs) > 0


def test_no_probe_or_exploration_where_even_k_plus_1_tokens_could_not_pay():
    """On the CPU profile at B=8 a round of budget k costs 1.2 + k batched AR steps: no budget can pay
    even if every request accepted its whole tree, so a session deep into its rounds (the prior says so
    too) must play AR every round. Without the upper-bound check the probe schedule played the largest
    budget costing at most `probe_cost` AR steps every 16-1024 rounds, at a loss each time."""
    pol = started(AutoBudget(CPU, prior()))
    reqs = fresh(8)
    played = []
    for _ in range(300):
        k = pol.choose(RoundInfo(reqs))
        played.append(k)
        trees = [DraftTree.chain(list(range(k + 1))) for _ in reqs]
        pol.observe(RoundResult(trees, [list(range(min(k, 2) + 1))] * 8))
    assert set(played) == {0}
    assert pol.probe_budget(8) > 0  # a probe budget exists: it is the bound that keeps it unplayed


def test_a_probe_plays_only_as_far_as_a_budget_could_pay():
    """SmolLM2 at 16 requests on 2 cores (measured 2026-12-06): budget 1 costs ~1.8 batched AR steps and
    its request accepts a draft 81% of the time, so it is at break-even and its upper bound keeps it worth
    a look; budget 4 costs ~3.6 and accepts no more. Once one probe measured budget 4, only budget 1 could
    pay even on its bound: every later probe must play budget 1, which measures all that could pay. The
    old rule played the probe budget (4) at every scheduled probe, ~1.8 AR steps lost each time (three
    probes in 190 rounds: 5.4 AR steps, 2.8% of the rounds)."""
    cost = profile({16: 0.6})  # cost(k, 16) = 1.2 + 0.6 k: 1.8 / 2.4 / 3.6 at budgets 1 / 2 / 4
    smollm2 = {1: 1.575, 2: 1.739, 4: 1.856, 8: 2.399, 16: 2.987}  # the shipped head's calibration
    pol = started(AutoBudget(cost, prior(smollm2, rounds=153)))
    probe = pol.probe_budget(16)
    assert probe == 4
    reqs = fresh(16)
    played = []
    for r in range(190):
        k = pol.choose(RoundInfo(reqs))
        played.append(k)
        # 13 of 16 requests accept exactly one draft (which three miss rotates with the round)
        drafts = [0 if (i + r) % 16 in (3, 9, 14) else 1 for i in range(16)]
        accepted = [list(range(min(k, d) + 1)) for d in drafts]
        for st, acc in zip(reqs, accepted, strict=True):
            if k:
                st.observe(acc, k)
        pol.observe(RoundResult([DraftTree.chain(list(range(k + 1))) for _ in reqs], accepted))
    trees = [k for k in played if k]
    assert trees.count(probe) == 1, played  # the first probe: budget 4 had never been seen
    assert set(trees) == {1, probe}, played  # every other look is at budget 1
    assert played.count(0) >= 180, played


def test_the_upper_bound_is_tight_with_evidence_and_loosens_as_it_ages():
    pol = started(AutoBudget(GPU, prior(), memory=64))
    assert pol.optimistic_tau(16, 3.0) == 17.0  # never observed: anything up to k + 1 tokens
    reqs = fresh(4)
    for _ in range(20):  # budget-16 trees, accept lengths 3 and 4 alternating per request
        trees = [DraftTree.chain(list(range(17))) for _ in reqs]
        pol.observe(RoundResult(trees, [list(range(3 + (i % 2))) for i in range(4)]))
        pol._batch = None
    n, var = pol.stats.count(16), pol.stats.variance(16)
    assert n == 64 and var == pytest.approx(0.25)  # 80 request-rounds faded to `memory`
    fresh_bound = pol.optimistic_tau(16, 3.5)
    assert fresh_bound == pytest.approx(3.5 + 2.0 * (0.25 / 64) ** 0.5)
    pol._session_round += 64  # 64 rounds without seeing budget 16: its rounds count half
    assert pol.optimistic_tau(16, 3.5) == pytest.approx(3.5 + 2.0 * (0.25 / 32) ** 0.5)


# ------------------------------------------------------------------------------------------ measuring and caching
def tiny_head(target: TargetModel, layers: int = 1) -> DraftHead:
    torch.manual_seed(0)
    cfg = DraftHeadConfig.for_target(
        target.config, num_hidden_layers=layers, block_size=8, mask_token_id=TINY_VOCAB - 1
    )
    return DraftHead(cfg).eval()


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir) -> TargetModel:
    return TargetModel.from_pretrained(tiny_target_dir)


def measure_kw() -> dict:
    return {"kv_len": 32, "nodes": SMALL_LADDER, "repeats": 1}


def test_batch_sizes_follow_the_engine_and_the_backend_slots(tiny_target):
    head = tiny_head(tiny_target)
    assert batch_sizes_for(TorchBackend(tiny_target, head, max_batch=64)) == [1, 2, 4, 8]  # the default cap
    assert batch_sizes_for(TorchBackend(tiny_target, head, max_batch=64), 6) == [1, 2, 4, 6]
    assert batch_sizes_for(TorchBackend(tiny_target, head, max_batch=3), 8) == [1, 2, 3]
    assert batch_sizes_for(TorchBackend(tiny_target, head, max_batch=1), 8) == [1]
    assert batch_sizes_for(TorchBackend(tiny_target, head), 1) == [1]


def test_measured_batch_dimension_and_the_backend_left_clean(tiny_target):
    backend = TorchBackend(tiny_target, tiny_head(tiny_target), max_batch=4)
    prof = measure_cost_profile(backend, max_batch=4, **measure_kw())
    assert prof.batch_sizes == [1, 2, 4] and prof.max_measured_batch == 4
    for b, nodes in zip(prof.batch_sizes, prof.nodes, strict=True):
        assert nodes[0] == 1 and set(nodes) <= set(SMALL_LADDER) and len(nodes) >= 2
        ratios = [prof.cost(n - 1, b) for n in nodes]
        assert ratios[0] == 1.0 and all(r > 1.0 for r in ratios[1:])  # a draft costs something
        secs = prof.round_s[prof.batch_sizes.index(b)]
        assert all(x <= y for x, y in zip(secs, secs[1:], strict=False))  # monotone fit in N
    assert "batch 4:" in prof.summary()
    # every slot it used is free again and the backend decodes as before
    assert all(backend.past_length(s) == 0 and backend.kv.group(s).size == 1 for s in range(4))
    assert backend.prefill(torch.tensor([3, 4, 5]), 1).shape == (TINY_VOCAB,)


def test_profile_cache_round_trips_completes_and_refuses_another_model(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("JETFLOW_PL_CACHE_DIR", str(tmp_path))
    backend = TorchBackend(tiny_target, tiny_head(tiny_target), max_batch=8)
    first = cost_profile_for(backend, max_batch=4, **measure_kw())
    path = cache_file(fingerprint(backend))
    assert path.is_file() and path.is_relative_to(tmp_path) and first.batch_sizes == [1, 2, 4]
    loaded = CostProfile.load(path)
    # every field survives the JSON round trip
    assert loaded == first and loaded.version == PROFILE_VERSION == 5

    import jetflow_pl.decoding.budget.measure_costs as mc

    asked: list[list[int]] = []
    real = mc.measure_rounds

    def recording(backend, sizes, *a, **k):
        asked.append(list(sizes))
        return real(backend, sizes, *a, **k)

    def no_measuring(*a, **k):
        raise AssertionError("a cached, matching profile must not be re-measured")

    monkeypatch.setattr(mc, "measure_cost_profile", no_measuring)
    monkeypatch.setattr(mc, "measure_rounds", recording)
    assert cost_profile_for(backend, max_batch=4).batch_sizes == [1, 2, 4] and asked == []  # covered
    wider = cost_profile_for(backend, max_batch=8)  # the engine now batches 8: only B = 8 is measured
    assert asked == [[8]]
    assert wider.batch_sizes == [1, 2, 4, 8] and wider.round_s[:3] == first.round_s
    assert wider.nodes[3][0] == 1 and set(wider.nodes[3]) <= set(first.nodes[0])  # the batch-1 tree sizes
    assert CostProfile.load(path) == wider  # and the cache file now holds it

    # a given file that lacks a batch size is completed and written back
    given = tmp_path / "given.json"
    given.write_text(
        json.dumps(
            dict(
                json.loads(path.read_text()),
                batch_sizes=[1],
                nodes=wider.nodes[:1],
                round_s=wider.round_s[:1],
            )
        )
    )
    asked.clear()
    upgraded = cost_profile_for(backend, given, max_batch=2)
    assert asked == [[2]] and upgraded.batch_sizes == [1, 2]
    assert CostProfile.load(given).batch_sizes == [1, 2]

    # a profile measured for another head stays refused, whatever its batch dimension
    other = TorchBackend(tiny_target, tiny_head(tiny_target, layers=2), max_batch=8)
    with pytest.raises(CostProfileMismatch, match="measured for another model or machine"):
        cost_profile_for(other, given, max_batch=2)
    # a file of an earlier format (verify, build and draft timed apart) is one error that says what to do
    with pytest.raises(UserInputError, match="version 4, expected 5: delete it to re-measure"):
        CostProfile.load(_with_version(given, tmp_path, 4))


def _with_version(src, tmp_path, version: int):
    data = json.loads(src.read_text())
    data["version"] = version
    out = tmp_path / f"v{version}.json"
    out.write_text(json.dumps(data))
    return out


def test_a_tree_counts_at_most_the_tokens_a_request_may_still_take():
    """On a profile where speculation pays at every size, a request with one token left gets AR (a tree
    cannot give it more than that one token), alone and in a batch; the bound lasts one round."""
    pol = started(AutoBudget(GPU, prior()))
    roomy = pol.best()
    assert roomy > 0
    assert pol.choose(RoundInfo(fresh(1), [1])) == 0
    pol.observe(RoundResult([DraftTree.chain([5])], [[0]]))
    assert pol._remaining is None and pol.choose(RoundInfo()) == roomy  # the bound was for that round only
    assert pol.choose(RoundInfo(fresh(4), [1, 1, 1, 1])) == 0
    pol.observe(RoundResult([DraftTree.chain([5])] * 4, [[0]] * 4))
    # two requests with one token left, two with room: each counts min(tau_i(k), left_i), by hand
    reqs = fresh(4)
    pol.choose(RoundInfo(reqs, [1, 1, 2, 40]))
    session = pol.estimates()
    got = pol.batch_speeds(reqs)
    for k, v in got.items():
        tau_k = pol.request_estimates(reqs[0], session)[k]  # fresh requests: all at the session estimate
        assert v == pytest.approx((1 + 1 + min(tau_k, 2) + tau_k) / (4 * pol.round_cost(k, 4)))
    assert got[0] == pytest.approx(1.0)  # AR's one token per request is never capped
    pol.observe(RoundResult([DraftTree.chain([5])] * 4, [[0]] * 4))  # the round is over: no bound now
    assert pol.batch_speeds(reqs)[roomy] > got[roomy]


# ------------------------------------------------------------------------------------------ lossless batching
pair_needed = pytest.mark.skipif(
    not (SMALL_HEAD_DIR / "model.safetensors").is_file(), reason="shipped toy head missing"
)


@pytest.fixture(scope="module")
def toy():
    """The shipped toy pair, 8 held-out prompts and each one's greedy AR tokens decoded alone."""
    from transformers import AutoTokenizer

    from data_gen.toy.tokenizer import prompt_ids

    head = DraftHead.from_pretrained(str(SMALL_HEAD_DIR)).eval()
    target = TargetModel.from_pretrained(SMALL_TARGET_DIR, head.config.target_layer_ids)
    tok = AutoTokenizer.from_pretrained(SMALL_TARGET_DIR)
    prompts = [prompt_ids(tok, r["prompt"]) for r in heldout_prompts("math", 8)]
    ar = ARGenerator(TorchBackend(target), eos_token_id=EOS)
    return head, target, prompts, [ar.generate(p, 24).tokens for p in prompts]


def closed_loop(engine, prompts, max_new: int):
    """Keep the engine full: a new request joins as soon as one finishes; (handles, most decoding at once)."""
    handles, pending, peak = [], list(prompts), 0
    while pending or not engine.idle:
        while pending and engine.num_active + engine.num_waiting < engine.max_batch:
            handles.append(engine.submit(pending.pop(0), max_new))
        engine.step()
        peak = max(peak, len(engine._decoding))
    return handles, peak


@pair_needed
@pytest.mark.parametrize("batch", (1, 2, 4, 8))
def test_batch_aware_auto_is_lossless_at_every_batch_size(toy, batch):
    """A GPU-like injected profile, so `auto` really drafts inside batches (shared budgets that change
    from round to round): every request's tokens equal its AR tokens decoded alone."""
    head, target, prompts, refs = toy
    # check_costs off: the GPU-like profile, not this CPU's clock, is what makes it draft inside batches
    pol = AutoBudget(GPU, prior(), explore_every=1, explore_margin=0.9, check_costs=False)
    gen = SpeculativeGenerator(TorchBackend(target, head, max_batch=batch), pol, width=4, eos_token_id=EOS)
    engine = gen.engine(max_batch=batch, prefill_chunk=None)  # whole prompts: the batch fills at once
    handles, peak = closed_loop(engine, prompts, 24)
    for h, ref in zip(handles, refs, strict=True):
        assert h.done and h.tokens == ref[:24]
    assert peak == batch  # the batch really filled
    played = {k for h in handles for k in h.result.budgets}
    assert len(played - {0}) >= 2, played  # drafted, at more than one budget
    assert sum(h.result.tau for h in handles) / len(handles) > 1.5  # multi-token acceptance happened


@pair_needed
def test_the_decode_loop_tells_auto_each_requests_tokens_left(toy):
    """Before every round the loop tells the policy what each request may still produce (max_new_tokens
    minus its tokens so far, in the round's request order); a request with one token left is decoded
    with AR even where speculation pays."""
    head, target, prompts, refs = toy
    told: list[list[int]] = []

    class Recording(AutoBudget):
        def choose(self, info):
            told.append(list(info.remaining))
            return super().choose(info)

    pol = Recording(GPU, prior(), check_costs=False)
    gen = SpeculativeGenerator(TorchBackend(target, head, max_batch=2), pol, width=4, eos_token_id=EOS)
    engine = gen.engine(max_batch=2, prefill_chunk=None)
    limits = (24, 3)
    handles = [engine.submit(p, n) for p, n in zip(prompts[:2], limits, strict=True)]
    while not engine.idle:
        # a request prefilled in this step draws its first token before the round
        before = [
            n - max(1, len(h.result.tokens)) for h, n in zip(handles, limits, strict=True) if not h.done
        ]
        rounds = len(told)
        engine.step()
        assert len(told) == rounds + 1 and told[-1] == before
    for h, ref, n in zip(handles, refs[:2], limits, strict=True):
        assert h.tokens == ref[:n]
    assert handles[0].result.budgets[0] > 0  # it speculates where there is room ...
    alone = engine.submit(prompts[2], 2)  # ... but one token left: nothing a tree could add
    engine.run()
    assert told[-1] == [1] and alone.result.budgets == [0] and alone.tokens == refs[2][:2]


@pair_needed
def test_measured_batch_profile_in_a_live_engine_is_lossless(toy, tmp_path, monkeypatch):
    """`auto` with no cached profile at batch 4: the engine measures batch sizes 1, 2 and 4 (slots 0..3)
    before any request owns KV, and the requests come out exact."""
    monkeypatch.setenv("JETFLOW_PL_CACHE_DIR", str(tmp_path))
    head, target, prompts, refs = toy
    gen = SpeculativeGenerator(TorchBackend(target, head, max_batch=4), "auto", width=4, eos_token_id=EOS)
    handles, peak = closed_loop(gen.engine(max_batch=4), prompts, 24)
    for h, ref in zip(handles, refs, strict=True):
        assert h.tokens == ref[:24]
    assert peak == 4
    (cached,) = (tmp_path / "cost_profiles").glob("*.json")
    assert CostProfile.load(cached).batch_sizes == [1, 2, 4]
