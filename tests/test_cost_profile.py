"""Cost profiles: measured through a real backend, cached per machine and model, refused when they belong
to another model or machine. No assertion on the measured times themselves (no wall-clock checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB

from jetflow_pl.decoding.budget.cost_profile import (
    DEFAULT_REPEATS,
    QUICK_REPEATS,
    CostProfile,
    CostProfileMismatch,
    cache_file,
    fingerprint,
)
from jetflow_pl.decoding.budget.measure_costs import cost_profile_for, kv_slack, measure_cost_profile
from jetflow_pl.errors import UserInputError
from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.target import TargetModel

SMALL_LADDER = (1, 2, 5, 17)


def head_for(target: TargetModel, layers: int = 1) -> DraftHead:
    torch.manual_seed(0)
    cfg = DraftHeadConfig.for_target(
        target.config, num_hidden_layers=layers, block_size=8, mask_token_id=TINY_VOCAB - 1
    )
    return DraftHead(cfg).eval()


@pytest.fixture(scope="module")
def target(tiny_target_dir) -> TargetModel:
    return TargetModel.from_pretrained(tiny_target_dir)


@pytest.fixture()
def backend(target) -> TorchBackend:
    return TorchBackend(target, head_for(target))


def quick(backend, **kw) -> CostProfile:
    return measure_cost_profile(backend, kv_len=32, nodes=SMALL_LADDER, repeats=1, **kw)


class LimitedBackend(TorchBackend):
    """A backend stating a tree limit, as an engine with an optimization profile does."""

    max_tree_nodes = 5


def test_measured_profile_shape_and_ratios(backend):
    prof = quick(backend)
    assert prof.batch_sizes == [1, 2, 4, 8] and prof.nodes[0] == list(SMALL_LADDER)  # the backend's default
    assert prof.budgets == [0, 1, 4, 16]
    assert prof.kv_len == 32 and prof.t1 > 0 and prof.cost(0) == 1.0
    # a round of more nodes is never cheaper (the fit keeps noise from saying so), and a round with a
    # draft costs at least an AR round
    costs = [prof.cost(k) for k in prof.budgets]
    assert costs == sorted(costs) and min(costs[1:]) >= 1.0
    with pytest.raises(ValueError, match="was not measured"):
        prof.cost(8)
    # measuring leaves the backend usable: a fresh prefill decodes as before
    assert backend.prefill(torch.tensor([3, 4, 5])).shape == (TINY_VOCAB,)


def test_rounds_are_measured_through_the_decode_loop_near_the_profile_s_kv_length(target, monkeypatch):
    """The profile times `round.run_round` itself (the round decoding plays: it commits what it accepts,
    so the KV grows), and a measurement prefills again before the KV has grown by `kv_slack` positions:
    every timed verify runs within that many positions of `kv_len`, at every batch size."""
    import jetflow_pl.decoding.budget.measure_costs as mc

    backend = TorchBackend(target, head_for(target), max_batch=2)
    rounds, lengths = [], []
    real_round, real_verify = mc.run_round, backend.verify_batch

    def counting(settings, be, requests):
        rounds.append(len(requests))
        return real_round(settings, be, requests)

    def recording(slots, trees):
        lengths.extend(backend.past_length(s) for s in slots)
        return real_verify(slots, trees)

    monkeypatch.setattr(mc, "run_round", counting)
    monkeypatch.setattr(backend, "verify_batch", recording)
    prof = measure_cost_profile(backend, kv_len=32, nodes=SMALL_LADDER, repeats=2, max_batch=2)
    assert prof.batch_sizes == [1, 2] and set(rounds) == {1, 2}
    assert 32 <= min(lengths) and max(lengths) <= 32 + kv_slack(32)
    assert max(lengths) > 32  # rounds committed tokens: the KV grew between prefills


def test_ladder_is_capped_by_the_backend_limit_and_the_context(target):
    limited = LimitedBackend(target, head_for(target))
    assert quick(limited).nodes[0] == [1, 2, 5]
    # no head: only the AR step can be measured
    assert measure_cost_profile(TorchBackend(target), kv_len=16, nodes=SMALL_LADDER, repeats=1).nodes[0] == [
        1
    ]


def test_fingerprint_names_machine_software_backend_and_models(target, backend):
    fp = fingerprint(backend)
    for key in ("cpu", "gpu", "threads", "torch", "revision", "backend", "dtype", "device", "target", "head"):
        assert key in fp
    assert (
        fp["backend"] == "TorchBackend" and fp["device"] == "cpu" and fp["threads"] == torch.get_num_threads()
    )
    other_head = TorchBackend(target, head_for(target, layers=2))
    assert fingerprint(other_head)["head"] != fp["head"]
    assert fingerprint(other_head)["target"] == fp["target"]
    assert fingerprint(TorchBackend(target))["head"] == "none"


def test_cache_measures_once_then_reuses(backend, tmp_path, monkeypatch):
    first = cost_profile_for(backend, cache_dir=tmp_path, kv_len=32, nodes=SMALL_LADDER, repeats=1)
    path = cache_file(fingerprint(backend), tmp_path)
    assert path.is_file() and "measured now" in first.source

    def no_measuring(*a, **k):
        raise AssertionError("a cached, matching profile must not be re-measured")

    monkeypatch.setattr("jetflow_pl.decoding.budget.measure_costs.measure_cost_profile", no_measuring)
    again = cost_profile_for(backend, cache_dir=tmp_path)
    assert again.source == str(path) and again.round_s == first.round_s


def test_a_first_measurement_is_quick_and_measure_costs_replaces_it_in_full(backend, tmp_path, monkeypatch):
    """Nothing cached: one timed pass per batch size (`QUICK_REPEATS`), so a first `auto` answers after a
    bounded wait; `full=True` (`--measure-costs`) replaces that quick profile on disk by the full one, and
    a full profile is then reused, never re-measured."""
    first = cost_profile_for(backend, cache_dir=tmp_path, kv_len=32, nodes=SMALL_LADDER)
    path = cache_file(fingerprint(backend), tmp_path)
    assert first.repeats == QUICK_REPEATS and first.quick and "quick, one pass" in first.source
    assert CostProfile.load(path).quick
    assert cost_profile_for(backend, cache_dir=tmp_path).source == str(path)  # used as it is by default
    full = cost_profile_for(backend, cache_dir=tmp_path, full=True, kv_len=32, nodes=SMALL_LADDER)
    assert full.repeats == DEFAULT_REPEATS and not full.quick and "re-measured in full" in full.source
    assert not CostProfile.load(path).quick

    def no_measuring(*a, **k):
        raise AssertionError("a full profile must not be re-measured")

    monkeypatch.setattr("jetflow_pl.decoding.budget.measure_costs.measure_cost_profile", no_measuring)
    assert cost_profile_for(backend, cache_dir=tmp_path, full=True).source == str(path)


def test_the_progress_bar_counts_every_pass_of_the_measurement(target, monkeypatch):
    """The bar's total is the passes the measurement really runs (warm-up and timed, at every batch size),
    so it ends at 100%, not short of it or past it."""
    import tqdm.auto

    bars = []

    class Recorder:
        def __init__(self, total, disable, **kw):
            self.total, self.disable, self.n = total, disable, 0
            bars.append(self)

        def update(self, k: int = 1) -> None:
            self.n += k

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    batched = TorchBackend(target, head_for(target), max_batch=4)
    measure_cost_profile(batched, kv_len=32, nodes=SMALL_LADDER, repeats=2, max_batch=4, progress=True)
    measure_cost_profile(batched, kv_len=32, nodes=SMALL_LADDER, repeats=1, max_batch=1)
    (full, single) = bars
    assert not full.disable and full.total == 3 * (1 + 2) == full.n  # batch sizes 1, 2, 4
    assert single.disable and single.total == 2 == single.n  # no bar unless asked; batch 1


def test_stale_or_corrupt_cache_is_remeasured(backend, tmp_path):
    prof = cost_profile_for(backend, cache_dir=tmp_path, kv_len=32, nodes=SMALL_LADDER, repeats=1)
    path = cache_file(prof.fingerprint, tmp_path)
    data = json.loads(path.read_text())
    data["fingerprint"]["threads"] = 999  # as if measured with another thread count
    path.write_text(json.dumps(data))
    again = cost_profile_for(backend, cache_dir=tmp_path, kv_len=32, nodes=SMALL_LADDER, repeats=1)
    assert "measured now" in again.source and again.fingerprint["threads"] == torch.get_num_threads()
    assert json.loads(path.read_text())["fingerprint"]["threads"] == torch.get_num_threads()
    path.write_text("{ truncated")
    again = cost_profile_for(backend, cache_dir=tmp_path, kv_len=32, nodes=SMALL_LADDER, repeats=1)
    assert "measured now" in again.source and CostProfile.load(path).nodes[0] == list(SMALL_LADDER)
    data = json.loads(path.read_text())
    data["version"] = 4  # a profile of the earlier format, cached before an upgrade: measured again
    path.write_text(json.dumps(data))
    again = cost_profile_for(backend, cache_dir=tmp_path, kv_len=32, nodes=SMALL_LADDER, repeats=1)
    assert "measured now" in again.source and CostProfile.load(path).version == 5


def test_explicit_profile_of_another_model_or_machine_is_refused(target, backend, tmp_path):
    path = tmp_path / "mine.json"
    made = cost_profile_for(backend, path, kv_len=32, nodes=SMALL_LADDER, repeats=1)  # missing: measured
    assert path.is_file() and CostProfile.load(path).round_s == made.round_s
    assert cost_profile_for(backend, path).source == str(path)  # matching: used as it is
    other = TorchBackend(target, head_for(target, layers=2))
    with pytest.raises(CostProfileMismatch, match="measured for another model or machine") as info:
        cost_profile_for(other, path)
    msg = str(info.value)
    assert "\n" not in msg and "head:" in msg and str(path) in msg
    data = json.loads(path.read_text())
    data["fingerprint"]["cpu"] = "Some Other CPU"
    path.write_text(json.dumps(data))
    with pytest.raises(CostProfileMismatch, match="cpu: 'Some Other CPU'"):
        cost_profile_for(backend, path)
    assert isinstance(info.value, UserInputError)


def test_unreadable_profiles_are_one_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(UserInputError, match="bad.json is not readable"):
        CostProfile.load(bad)
    good = {"version": 5, "fingerprint": {}, "batch_sizes": [1], "kv_len": 1, "repeats": 1}
    bad.write_text(json.dumps(dict(good, nodes=[[2, 3]], round_s=[[1, 1]])))
    with pytest.raises(UserInputError, match="must start at N = 1"):
        CostProfile.load(bad)
    # an earlier format (verify, build and draft timed apart) is refused in one line saying what to do
    bad.write_text(json.dumps(dict(good, version=2, nodes=[1, 2], verify_s=[1, 1.5], draft_s=0.2)))
    with pytest.raises(UserInputError, match="version 2, expected 5: delete it to re-measure") as info:
        CostProfile.load(bad)
    assert "\n" not in str(info.value)


def test_ladder_leaves_room_in_the_context(backend):
    from jetflow_pl.decoding.budget.cost_profile import LADDER_NODES
    from jetflow_pl.decoding.budget.measure_costs import ladder_for

    # 1024 positions: the KV length is capped at half the context and the ladder must fit after it and
    # the growth a measurement allows before it prefills again
    nodes, kv_len = ladder_for(backend, 900, LADDER_NODES)
    assert kv_len == 512
    assert nodes[0] == 1 and 2 * max(nodes) + kv_len + kv_slack(kv_len) < backend.max_positions
    assert nodes == [n for n in LADDER_NODES if n <= max(nodes)]


def test_graph_backend_is_measured_through_the_same_protocol(target):
    from jetflow_pl.runtime.graph_backend import TorchGraphBackend

    graph = TorchGraphBackend(target, head_for(target), topk=4)
    prof = quick(graph)
    assert prof.nodes[0] == list(SMALL_LADDER)
    assert prof.fingerprint["backend"].startswith("TorchGraphBackend")
    assert prof.fingerprint["backend"] != fingerprint(TorchBackend(target, head_for(target)))["backend"]


def test_isotonic_fit_keeps_order_and_least_squares():
    from jetflow_pl.decoding.budget.measure_costs import isotonic

    assert isotonic([1.0, 1.2, 1.5]) == [1.0, 1.2, 1.5]  # already in order: unchanged
    fit = isotonic([1.0, 2.5, 2.8, 2.5, 1.2, 3.0])
    assert all(a <= b for a, b in zip(fit, fit[1:], strict=False))
    assert fit[0] == 1.0 and fit[-1] == 3.0
    assert fit[1:5] == pytest.approx([2.25] * 4)  # the violating run pooled to its mean
    assert sum(fit) == pytest.approx(1.0 + 2.5 + 2.8 + 2.5 + 1.2 + 3.0)  # PAV preserves the total


def test_measured_ratios_are_monotone_and_spread_is_recorded(backend):
    prof = measure_cost_profile(backend, kv_len=32, nodes=SMALL_LADDER, repeats=2)
    ratios = [prof.cost(k) for k in prof.budgets]
    assert ratios[0] == 1.0 and all(a <= b for a, b in zip(ratios, ratios[1:], strict=False))
    assert prof.spread >= 0.0 and isinstance(prof.noisy, bool)
    assert ("NOISY" in prof.summary()) == prof.noisy


def test_fingerprint_tells_batched_graphs_from_batch_1_graphs():
    """An engine exported with --max-batch runs other graphs (padded KV, per-request lengths): its costs
    are not a batch-1 engine's of the same model and variant, so the two never share a cached profile."""

    class Engine:  # the two attributes `fingerprint` reads from a graph backend
        def __init__(self, batched: bool) -> None:
            self.config = {"target": {"num_layers": 2}, "head": {"num_layers": 1}, "variant": "portable"}
            if batched:
                self.config.update(batched=True, max_batch=4)
            self.device = "cpu"

    one, many = fingerprint(Engine(False)), fingerprint(Engine(True))
    assert one["backend"].endswith("Engine/portable") and many["backend"].endswith("Engine/portable+batched")
    assert cache_file(one, Path("c")) != cache_file(many, Path("c"))


def test_fingerprint_tells_onnx_runtime_thread_pools_apart():
    """ONNX Runtime keeps its own intra-op pool, which torch's thread count does not describe: on this
    project's 2-core machine a 2-thread pool made SmolLM2 tree rounds 1.3x dearer than a 1-thread pool.
    A profile measured with one pool size is never reused for another; the default pool (None) keeps the
    fingerprint it had before pool sizes were recorded."""

    class Engine:
        def __init__(self, threads: int | None) -> None:
            self.config = {"target": {"num_layers": 2}, "head": {"num_layers": 1}, "variant": "portable"}
            self.device = "cpu"
            self.intra_op_threads = threads

    default, one, two = (fingerprint(Engine(t)) for t in (None, 1, 2))
    assert default["backend"].endswith("Engine/portable")
    assert one["backend"].endswith("Engine/portable+threads=1")
    assert two["backend"].endswith("Engine/portable+threads=2")
    assert len({cache_file(f, Path("c")) for f in (default, one, two)}) == 3


class _VirtualClock:
    """`time.perf_counter` for the round: advances only when the backend below says a call took time."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class FirstRoundAfterPrefillIsSlow(TorchBackend):
    """Runs the real forwards, but the profile's clock sees only chosen costs: a verify costs `PER_ROW`
    seconds per verified row, drafts cost nothing, and the first verify after a prefill pays `PENALTY` on
    top, the one-time work a real backend does there (a batch's KV gathered from its prefilled slots)."""

    PER_ROW, PENALTY = 1.0, 3.0

    def __init__(self, *args, clock: _VirtualClock, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clock, self.fresh = clock, False

    def prefill(self, prompt_ids, slot: int = 0):
        self.fresh = True
        return super().prefill(prompt_ids, slot)

    def verify_batch(self, slots, trees):
        out = super().verify_batch(slots, trees)
        self.clock.now += self.PER_ROW * sum(t.num_nodes for t in trees) + self.PENALTY * self.fresh
        self.fresh = False
        return out


def test_the_first_round_after_a_prefill_is_not_timed(target, monkeypatch):
    """With round time proportional to the rows verified, every measured t(N)/t(1) must be N exactly, at
    batch 1 and batched. Timing the first round after a prefill gave the AR half of each ascending pass's
    first pair the one-time penalty, so the smallest tree looked cheap (real SmolLM2, torch, 16 slots:
    t(B, 2)/t(B, 1) measured 1.0 where decoding rounds take 1.4-1.7): 2 / (1 + 3) = 0.5 -> clamped to 1."""
    import jetflow_pl.decoding.round as round_module

    clock = _VirtualClock()
    monkeypatch.setattr(round_module, "time", clock)
    backend = FirstRoundAfterPrefillIsSlow(target, head_for(target), max_batch=4, clock=clock)
    prof = measure_cost_profile(backend, kv_len=32, nodes=SMALL_LADDER, repeats=3, max_batch=4)
    assert prof.batch_sizes == [1, 2, 4] and prof.nodes[0] == list(SMALL_LADDER)
    for nodes, secs in zip(prof.nodes, prof.round_s, strict=True):
        assert len(nodes) >= 3  # the ladder reached past the smallest tree
        assert [v / secs[0] for v in secs] == pytest.approx(nodes, rel=1e-9)
