"""`AutoBudget`: per round, the budget with the best expected tokens per unit of cost; AR when none pays.

The rules (why, and what was measured: docs/ARCHITECTURE.md, "Choosing the budget"):

- **Speed.** At budget k it is tau(k) / cost(k): expected tokens per round over the round's cost in AR
  steps (`CostProfile.cost`; cost(0) = tau(0) = 1). The best k is played, 0 unless some k beats AR by
  `min_gain`, so `auto` is never expected to be slower than AR.
- **tau(k)** is the mean accept length at k over the rounds seen, built up the ladder from paired gains
  (`estimates`) and shrunk toward the head's prior (`AcceptanceProfile`, worth `prior_weight` rounds).
  One round at budget K tells every k <= K (`acceptance.py`), so learning costs nothing; `learn` keeps
  the rounds of earlier generations, fading over `memory` rounds per budget.
- **Looking above the choice.** With no prior, the first `probe_rounds` rounds play the probe budget (the
  largest costing at most `probe_cost` AR steps). Every `explore_every` rounds the next larger budget is
  played once when its estimate is within `explore_margin` of the best, and on a session-wide schedule
  (`probe_every`) a probe is played whatever the estimates say; intervals double while looking changes
  nothing, and a probe in which a larger budget beat the choice on that same round is followed by
  another. Only budgets whose upper confidence bound, (tau + `confidence` standard errors) / cost, beats
  the choice are looked at, and a probe plays the largest of them.
- **A batch** (`RoundInfo` with B requests) shares one budget: its speed is the sum over requests of
  min(tau_i(k), tokens left_i) over B * cost(k, B), tau_i being the request's own accept lengths shrunk
  toward the session's (`request_weight`). A batch of one is exactly the batch-1 policy.
- **The clock** (`check_costs`): every round's seconds (`RoundResult.seconds`) are compared with the
  profile's, per budget and batch bucket; once `timing_samples` AR and tree rounds are timed there, a
  budget's cost is the profile's times (tree / AR observed-over-profiled ratio), only ever raised (times
  taken at different moments cannot show a tree cheaper). AR times come from AR check rounds every
  `check_every` rounds (doubling while they change nothing); times expire after `max_check_every`
  rounds, so a session sent to AR by a burst of load speculates again once it passes.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from jetflow_pl.decoding.budget.acceptance import AcceptanceProfile, AcceptanceStats, accept_length_at
from jetflow_pl.decoding.budget.cost_profile import CostProfile
from jetflow_pl.decoding.budget.measure_costs import batch_sizes_for, cost_profile_for
from jetflow_pl.decoding.budget.policy import RoundInfo, RoundResult
from jetflow_pl.runtime.backend import DecodeBackend, max_budget
from jetflow_pl.tree import DraftTree

#: the least variance of an accept length that `AutoBudget`'s upper bound assumes: a few rounds that all
#: committed the same number of tokens do not show that the next one will (lengths are integers, and
#: 1/4 is the variance of one that is L or L+1 equally often, the least spread integer data can have
#: short of being constant)
VARIANCE_FLOOR = 0.25


class AutoBudget:
    """Per round, the budget with the best expected tau(k) / cost(k); 0 when none beats AR (module doc).

    Args:
        cost: a measured `CostProfile`; None = `cost_profile_for(backend, cost_profile_path, cache_dir)`
            at the first `start` (cached per machine and model; measured once when absent: a quick,
            one-pass profile, or the full one with `full_profile`, which also replaces a quick one on
            disk); `progress`: a progress bar while it is measured.
        prior: the head's `AcceptanceProfile` (None: probe first, see `probe_rounds`).
        prior_weight: pseudo-rounds the prior counts for (at most the rounds it was measured on).
        probe_rounds, probe_cost: without a prior, the first rounds play the largest budget costing at
            most `probe_cost` AR steps.
        explore_every, max_explore_every, explore_margin: re-exploring the next larger budget (when its
            estimate is within `explore_margin` of the best; per generation, interval doubling).
        probe_every, max_probe_every: re-probing whatever the estimates say, at the largest budget up to
            the probe budget that could pay on its upper bound, on a session-wide schedule that doubles
            while probing does not change the choice: this is what recovers from a wrong prior (one probe
            at K measures every k <= K), at a cost of at most `probe_cost` AR steps per probe, i.e.
            O(log rounds) probes over a session.
        min_gain: a budget must be expected to beat AR by this factor to be played instead of AR (the
            margin covers timing noise in the cost profile).
        cap: never choose more than this (None: the cost profile's ladder, capped by the backend).
        learn, memory: keep the rounds of earlier generations (the most recent `memory` per budget), so a
            session of many prompts probes only once without a prior and adapts to the data it decodes.
        request_weight: under batching, pseudo-rounds of the session estimate each request's own
            acceptance is shrunk toward (module doc).
        check_costs, timing_samples, timing_window, check_every, max_check_every: correcting the cost
            profile with the measured wall time of the rounds played (module doc); off: the profile alone.
        confidence: standard errors above a budget's estimated tau that its speed's upper bound adds;
            exploring or probing needs that bound to beat the choice (module doc).

    `max_budget` (the `BudgetPolicy` attribute) is None: the candidates are capped by the backend in
    `start`, so no budget this policy picks can exceed the backend's limit.
    """

    max_budget = None

    def __init__(
        self,
        cost: CostProfile | None = None,
        prior: AcceptanceProfile | None = None,
        *,
        cost_profile_path: str | Path | None = None,
        cache_dir: str | Path | None = None,
        full_profile: bool = False,
        progress: bool = False,
        prior_weight: float = 2.0,
        probe_rounds: int = 2,
        probe_cost: float = 4.0,
        explore_every: int = 4,
        max_explore_every: int = 64,
        explore_margin: float = 0.25,
        probe_every: int = 16,
        max_probe_every: int = 1024,
        min_gain: float = 1.05,
        cap: int | None = None,
        learn: bool = True,
        memory: int = 64,
        request_weight: float = 4.0,
        check_costs: bool = True,
        timing_samples: int = 2,
        timing_window: int = 5,
        check_every: int = 16,
        max_check_every: int = 512,
        confidence: float = 2.0,
    ) -> None:
        if confidence < 0:
            raise ValueError("confidence must be >= 0")
        self.confidence = float(confidence)
        # budget -> the session round it was last observed in (its evidence ages from there)
        self._seen_at: dict[int, int] = {}
        if timing_samples < 1 or timing_window < timing_samples or check_every < 1:
            raise ValueError("timing_samples >= 1, timing_window >= timing_samples, check_every >= 1")
        self.check_costs = bool(check_costs)
        self.timing_samples = int(timing_samples)
        self.timing_window = int(timing_window)
        self.check_every = int(check_every)
        self.max_check_every = max(int(max_check_every), self.check_every)
        # (batch bucket, budget) -> the last `timing_window` rounds' observed / profiled seconds, and the
        # session round of the last one (older than `max_check_every` rounds: expired, the load moved on)
        self._times: dict[tuple[int, int], deque[float]] = {}
        self._timed_at: dict[tuple[int, int], int] = {}
        # per batch bucket: the session round from which the next AR check round is due, and the interval
        self._next_check: dict[int, int] = {}
        self._check_interval: dict[int, int] = {}
        self._checking: int | None = None  # the budget an AR check round stands in for
        if request_weight < 0:
            raise ValueError("request_weight must be >= 0")
        self.request_weight = float(request_weight)
        self.max_batch = 1  # the most requests per round the cost profile covers (`start`)
        self._batch: Sequence[AcceptanceStats] | None = None
        # the tokens each request of the next round may still produce (`RoundInfo.remaining`; None: unbounded)
        self._remaining: list[int] | None = None
        if prior_weight < 0 or probe_rounds < 0 or probe_cost < 1 or explore_every < 1 or probe_every < 1:
            raise ValueError("prior_weight, probe_rounds >= 0; probe_cost, explore_every, probe_every >= 1")
        if not 0 <= explore_margin < 1 or min_gain < 1:
            raise ValueError("explore_margin must be in [0, 1) and min_gain >= 1")
        self.cost = cost
        self.prior = prior
        self.cost_profile_path = cost_profile_path
        self.cache_dir = cache_dir
        self.full_profile = bool(full_profile)
        self.progress = bool(progress)
        self.prior_weight = float(prior_weight)
        self.probe_rounds = int(probe_rounds)
        self.probe_cost = float(probe_cost)
        self.explore_every = int(explore_every)
        self.max_explore_every = max(int(max_explore_every), self.explore_every)
        self.explore_margin = float(explore_margin)
        self.probe_every = int(probe_every)
        self.max_probe_every = max(int(max_probe_every), self.probe_every)
        # session-wide probing schedule (kept across generations)
        self._session_round = 0
        self._probe_interval = self.probe_every
        self._next_probe_at = self.probe_every
        self.min_gain = float(min_gain)
        self.cap = cap
        self.learn = bool(learn)
        self.memory = max(1, int(memory))
        self.candidates: list[int] = [0]
        self.stats = AcceptanceStats([0])
        self._resolved_for: int | None = None
        self._reset_generation()

    # ---- per generation ---------------------------------------------------------------------------
    def _reset_generation(self) -> None:
        self._round = 0
        # the prior stands for a recent look at every budget: the first exploration waits an interval
        self._last_seen = {k: 0 for k in self.candidates}
        self._interval = self.explore_every
        seen = any(self.stats.counts[1:])
        self._probes_left = self.probe_rounds if self.prior is None and not seen else 0
        self._explored_from: int | None = None
        self._probing = False
        self._last_choice = 0

    def start(self, backend: DecodeBackend, max_batch: int = 1) -> None:
        """Resolve the cost profile for `backend` covering rounds of up to `max_batch` requests (measured or
        loaded the first time, completed when the engine now batches more), fix the candidates, reset the
        per-generation state."""
        self.max_batch = max(1, int(max_batch))
        # a profile given by the caller is used as given; one resolved here belongs to that backend (and is
        # completed when the engine now batches more requests than it covers)
        resolved_here = self._resolved_for is not None
        if (
            self.cost is None
            or (resolved_here and self._resolved_for != id(backend))
            or (resolved_here and self.cost.max_measured_batch < self._batch_limit(backend))
        ):
            self.cost = cost_profile_for(
                backend,
                self.cost_profile_path,
                self.cache_dir,
                max_batch=self.max_batch,
                full=self.full_profile,
                progress=self.progress,
            )
            self._resolved_for = id(backend)
        limit = max_budget(backend)
        if self.cap is not None:
            limit = min(limit, int(self.cap))
        can_draft = backend.block_size >= 2
        candidates = [k for k in self.cost.budgets if k == 0 or (can_draft and k <= limit)]
        if not self.learn or candidates != self.candidates:
            self.stats = AcceptanceStats(candidates)
        self.candidates = candidates
        self._reset_generation()

    def _batch_limit(self, backend: DecodeBackend) -> int:
        """The largest batch size the profile should cover for `backend` (1: no batching planned)."""
        return max([1, *batch_sizes_for(backend, self.max_batch)])

    # ---- estimates --------------------------------------------------------------------------------
    def estimates(self) -> dict[int, float]:
        """Current tau(k) for every candidate, built up the ladder: tau(k) = tau(k') + the expected gain
        of k over the next smaller candidate k', each gain the mean paired difference over the rounds that
        covered k (`AcceptanceStats.mean_gain`) shrunk toward the prior's difference, never negative (a
        larger tree contains the smaller one, so its expected accept length cannot be lower).

        Why gains and not each budget's own mean: budgets above the choice are only observed in the few
        rounds that explored or probed them, and text comes in easier and harder stretches. A probe that
        lands in an easy stretch would make its budget's own mean look better than the choice's mean over
        all rounds even where the larger tree gained nothing on those rounds; the paired gain is 0 there.
        Where every budget was observed on the same rounds, the sum of gains equals the plain mean."""
        out: dict[int, float] = {}
        tau, below = 1.0, 0
        for k in self.candidates:
            if k:
                n, gain = self.stats.count(k), self.stats.mean_gain(k)
                if self.prior is not None:
                    w = min(self.prior_weight, float(self.prior.rounds_at(k)))
                    prior_gain = max(0.0, self.prior.at(k) - self.prior.at(below))
                    g = (w * prior_gain + n * (gain or 0.0)) / (w + n) if w + n > 0 else 0.0
                else:
                    g = gain if gain is not None else 0.0
                tau += max(0.0, g)
            out[k], below = tau, k
        return out

    def speeds(self) -> dict[int, float]:
        """Expected speed of every candidate in AR tokens per AR step (AR itself: 1); a tree's yield counts
        at most the tokens the request may still produce (`RoundInfo.remaining`)."""
        assert self.cost is not None, "call start(backend) first"
        cap = self._cap(0)
        return {k: min(tau, cap) / self.round_cost(k) for k, tau in self.estimates().items()}

    def _cap(self, i: int) -> float:
        """The most tokens request `i` of the next round can take (inf: no bound noted)."""
        r = self._remaining
        return float(r[i]) if r is not None and i < len(r) else math.inf

    # ---- costs: the profile, checked against the clock --------------------------------------------
    def round_cost(self, budget: int, batch: int = 1) -> float:
        """Cost of a round at `budget` for `batch` requests in (batched) AR steps: the profile's, times the
        clock's ratio in this batch size's bucket (observed/profiled seconds of this budget's rounds, or of
        every tree round while it has too few, over those of AR rounds) where that ratio exceeds 1. Only
        raised, never lowered: times taken at different moments on a shared machine can make trees look
        cheaper with nothing cheaper about them (a burst of slow AR rounds once sent `auto` to 0.73x AR;
        docs/ARCHITECTURE.md, "Choosing the budget")."""
        assert self.cost is not None, "call start(backend) first"
        profiled = self.cost.cost(budget, batch)
        if budget == 0 or not self.check_costs:
            return profiled
        bucket = self._bucket(batch)
        ar = self._error(bucket, 0)
        tree = self._error(bucket, budget)
        if tree is None:
            tree = self._error(bucket, None)
        ratio = 1.0 if ar is None or tree is None else tree / ar
        return profiled * max(1.0, ratio)

    def _bucket(self, batch: int) -> int:
        """The batch sizes whose times are pooled: those the profile costs with the same measured row
        (the smallest measured size >= `batch`; 1 alone; above the largest, the largest). A batch that
        drains from 16 to 9 requests is one bucket, so its cost is not learned again at every size."""
        assert self.cost is not None
        b = max(1, int(batch))
        if b == 1:
            return 1
        sizes = self.cost.batch_sizes
        i = bisect_left(sizes, b)
        if i < len(sizes):
            return sizes[i]
        return sizes[-1] if sizes[-1] > 1 else b  # batch 1 alone measured: each size its own bucket

    def _fresh(self, bucket: int, budget: int | None) -> list[float]:
        """Unexpired observed/profiled seconds in `bucket` at `budget` (None: every budget > 0)."""
        return [
            x
            for (bb, k), xs in self._times.items()
            if bb == bucket
            and (k == budget if budget is not None else k > 0)
            and not self._expired(self._timed_at, (bb, k))
            for x in xs
        ]

    def _error(self, bucket: int, budget: int | None) -> float | None:
        """Lower median of observed/profiled seconds (robust to the slow first call of a new shape);
        None below `timing_samples` samples."""
        xs = sorted(self._fresh(bucket, budget))
        return xs[(len(xs) - 1) // 2] if len(xs) >= self.timing_samples else None

    def _expired(self, stamps: dict[tuple[int, int], int], key: tuple[int, int]) -> bool:
        """Whether the samples under `key` were last added over `max_check_every` session rounds ago."""
        return self._session_round - stamps[key] > self.max_check_every

    def _record(
        self,
        window: dict[tuple[int, int], deque[float]],
        stamps: dict[tuple[int, int], int],
        key: tuple[int, int],
        value: float,
    ) -> None:
        """Append `value` to `window[key]` (the last `timing_window` samples), starting over when the ones
        there expired rather than mixing in the old load's times, and stamp it with this session round."""
        if key in window and self._expired(stamps, key):
            window[key].clear()
        window.setdefault(key, deque(maxlen=self.timing_window)).append(value)
        stamps[key] = self._session_round

    def observe_time(self, budget: int, batch: int, seconds: float) -> None:
        """Wall time of one round played at `budget` (every tree of that size) for `batch` requests.

        Called by `observe` before the round's acceptance is recorded. Ends an AR check
        round: the next check waits an interval that doubles while checks do not change the choice.
        """
        if not self.check_costs or self.cost is None or not (seconds > 0 and math.isfinite(seconds)):
            return
        b = max(1, int(batch))
        if budget != 0 and budget not in self.candidates_at(b):
            return
        profiled = self.cost.cost(budget, b) * self.cost.ar_seconds(b)
        key = (self._bucket(b), int(budget))
        self._record(self._times, self._timed_at, key, float(seconds) / profiled)
        if budget == 0 and self._checking is not None:
            stood_in_for, self._checking = self._checking, None
            if self._error(key[0], 0) is None:
                return  # not enough AR times yet: the next round checks again
            batch_stats = self._batch if self._batch is not None and len(self._batch) == b else None
            now = self._best_of(self.speeds() if batch_stats is None else self.batch_speeds(batch_stats))
            interval = self._check_interval.get(key[0], self.check_every)
            interval = self.check_every if now != stood_in_for else min(2 * interval, self.max_check_every)
            self._check_interval[key[0]] = interval
            self._next_check[key[0]] = self._session_round + interval

    def _ar_check_due(self, batch: int) -> bool:
        """Whether the next round at `batch` should be an AR check round (speculating in its bucket, with
        tree rounds timed but AR's time there unknown, or its last check an interval ago)."""
        if not self.check_costs:
            return False
        bucket = self._bucket(batch)
        if self._error(bucket, 0) is None:
            return len(self._fresh(bucket, None)) >= self.timing_samples
        return self._session_round >= self._next_check.get(bucket, 0)

    def best(self) -> int:
        """The candidate with the highest expected speed (ties: the smaller budget); 0 unless some budget
        beats AR by `min_gain`."""
        return self._best_of(self.speeds())

    def _best_of(self, speeds: dict[int, float]) -> int:
        best, best_speed = 0, self.min_gain
        for k, v in speeds.items():
            if k and v > best_speed:
                best, best_speed = k, v
        return best

    def probe_budget(self, batch: int = 1) -> int:
        """The largest candidate whose round (of `batch` requests) costs at most `probe_cost` AR steps
        (batched; 0 if none)."""
        assert self.cost is not None
        ok = [k for k in self.candidates_at(batch) if k and self.round_cost(k, batch) <= self.probe_cost]
        return max(ok) if ok else 0

    # ---- a batch of requests ----------------------------------------------------------------------
    def candidates_at(self, batch: int) -> list[int]:
        """The candidates whose cost is known for a round of `batch` requests."""
        if batch <= 1:
            return self.candidates
        assert self.cost is not None
        known = set(self.cost.budgets_at(batch))
        return [k for k in self.candidates if k in known]

    def request_estimates(
        self, stats: AcceptanceStats, session: dict[int, float] | None = None
    ) -> dict[int, float]:
        """tau_i(k) of one request: its own mean accept length at k (`stats`, its rounds so far) shrunk
        toward the session's estimate by `request_weight` pseudo-rounds, non-decreasing in k. Above the
        largest budget the request has observed, K, it is tau_i(K) plus what the session expects a larger
        tree to add (session(k) - session(K)): a request that accepts little at K is not credited with
        the session's acceptance at 2K."""
        session = self.estimates() if session is None else session
        out: dict[int, float] = {}
        best_so_far = 1.0
        anchor: tuple[float, float] | None = None  # (tau_i(K), session(K)) at the last observed K
        w = self.request_weight
        for k, est in session.items():
            n = stats.count(k) if k and k in stats.budgets else 0
            if n > 0:
                own = (w * est + n * float(stats.mean(k) or 0.0)) / (w + n)
                anchor = (own, est)
                est = own
            elif anchor is not None:
                est = anchor[0] + max(0.0, est - anchor[1])
            best_so_far = max(best_so_far, est)
            out[k] = best_so_far
        return out

    def batch_speeds(self, requests: Sequence[AcceptanceStats]) -> dict[int, float]:
        """Expected speed of every candidate for a round of these requests, against `len(requests)` AR
        steps batched (AR itself: 1): sum of min(tau_i(k), tokens left_i) over B * cost(k, B)."""
        assert self.cost is not None, "call start(backend) first"
        b = len(requests)
        if b <= 1:
            return self.speeds()
        session = self.estimates()
        caps = [self._cap(i) for i in range(b)]
        per = [self.request_estimates(st, session) for st in requests]
        return {
            k: sum(min(t[k], c) for t, c in zip(per, caps, strict=True)) / (b * self.round_cost(k, b))
            for k in self.candidates_at(b)
        }

    def best_batch(self, requests: Sequence[AcceptanceStats]) -> int:
        """The shared budget with the highest expected speed for these requests; 0 unless some budget
        beats AR by `min_gain`."""
        return self._best_of(self.batch_speeds(requests))

    # ---- the policy -------------------------------------------------------------------------------
    def choose(self, info: RoundInfo) -> int:
        """The shared budget of one round of `info.requests` (each one's acceptance so far), counting at
        most `info.remaining` tokens per request (module doc); the bounds hold until the round is observed."""
        if self.cost is None:
            raise RuntimeError("AutoBudget.choose() before start(backend)")
        self._remaining = None if info.remaining is None else [max(1, int(r)) for r in info.remaining]
        self._explored_from = None
        self._probing = False
        self._checking = None
        self._batch = list(info.requests)
        self._last_choice = self._pick(self._batch)
        return self._last_choice

    def _pick(self, batch: Sequence[AcceptanceStats] | None = None) -> int:
        """The next budget: probing, then the best, with exploration (a batch's costs at its size)."""
        b = 1 if batch is None else len(batch)
        if self._probes_left > 0:
            self._probes_left -= 1
            return self.probe_budget(b)
        speeds = self.speeds() if batch is None else self.batch_speeds(batch)
        best = self._best_of(speeds)
        if best and self._ar_check_due(b):
            self._checking = best
            return 0
        if self._session_round >= self._next_probe_at:
            target = self._probe_target(best, speeds, b)
            if target:
                self._explored_from, self._probing = best, True
                return target
        above = [k for k in self.candidates_at(b) if k > best]
        if above:
            up = above[0]
            due = self._round - self._last_seen[up] >= self._interval
            near = speeds[up] >= (1.0 - self.explore_margin) * max(speeds[best], 1.0)
            if due and near and self._could_pay(best, up, speeds, b):
                self._explored_from = best
                return up
        return best

    def optimistic_tau(self, budget: int, estimate: float) -> float:
        """An upper confidence bound on tau(`budget`) around its `estimate`: `confidence` standard errors
        of the mean accept length above it (the variance at least `VARIANCE_FLOOR`; rounds weighted down
        by how long ago the budget was last observed), at most `budget + 1`; `budget + 1` below two rounds."""
        top = budget + 1.0
        if budget not in self.stats.budgets:
            return top
        n, var = self.stats.count(budget), self.stats.variance(budget)
        if var is None:
            return top
        age = max(0, self._session_round - self._seen_at.get(budget, self._session_round))
        n_eff = n * self.memory / (self.memory + age)
        return min(top, estimate + self.confidence * math.sqrt(max(var, VARIANCE_FLOOR) / n_eff))

    def _largest_that_could_pay(self, best: int, top: int, speeds: dict[int, float], batch: int) -> int:
        """The largest candidate in (best, top] that could beat the choice `best` (AR: by `min_gain`) at
        its upper confidence bound (`optimistic_tau`) and its cost for `batch` requests; 0 if none."""
        bar = speeds[best] if best else self.min_gain
        est = self.estimates()
        caps = [self._cap(i) for i in range(batch)]

        def bound(k: int) -> float:  # per request at most its tokens left, averaged over the batch
            top_k = self.optimistic_tau(k, est[k])
            return sum(min(top_k, c) for c in caps) / batch

        could = [
            k
            for k in self.candidates_at(batch)
            if best < k <= top and bound(k) / self.round_cost(k, batch) > bar
        ]
        return max(could, default=0)

    def _probe_target(self, best: int, speeds: dict[int, float], batch: int) -> int:
        """The budget a due probe plays over the choice `best`, 0 for none: the largest up to the probe
        budget that could pay, so the probe measures every budget that could and nothing that costs more
        without being able to (module doc)."""
        return self._largest_that_could_pay(best, self.probe_budget(batch), speeds, batch)

    def _could_pay(self, best: int, top: int, speeds: dict[int, float], batch: int) -> bool:
        """Whether some candidate in (best, top] could beat the choice `best` (`_largest_that_could_pay`)."""
        return self._largest_that_could_pay(best, top, speeds, batch) > 0

    def observe(self, result: RoundResult) -> None:
        """One round of the batch last chosen for: its wall time first (`observe_time`, when its trees all
        had one size), then every request's tree and accepted node ids."""
        if result.seconds is not None and result.tree_budget is not None:
            self.observe_time(result.tree_budget, result.batch, result.seconds)
        batch = self._batch if self._batch is not None and len(self._batch) == result.batch else None
        self._observe(list(result.trees), [list(a) for a in result.accepted], batch)
        self._batch = None

    def _observe(
        self,
        trees: list[DraftTree],
        accepted: list[Sequence[int]],
        batch: Sequence[AcceptanceStats] | None,
    ) -> None:
        """Record one round (one tree per request; `batch`: the requests' stats when it was a batch)."""
        for tree, acc in zip(trees, accepted, strict=True):
            self.stats.observe(acc, tree.budget)
        self.stats.fade(self.memory)
        b = 1 if batch is None else len(batch)

        def speeds() -> dict[int, float]:
            return self.speeds() if batch is None else self.batch_speeds(batch)

        def best() -> int:
            return self._best_of(speeds())

        # a budget counts as visited when it was played even if the tree came out smaller (near the end
        # of the context): otherwise an exploration that cannot happen would be retried every round
        covered = max(t.budget for t in trees)
        visited = max(covered, self._last_choice)
        for k in self.candidates:
            if k <= visited:
                self._last_seen[k] = self._round
            if k <= covered:  # observed: its evidence is fresh (age 0) once this round is counted
                self._seen_at[k] = self._session_round + 1
        if self._explored_from is not None:
            changed = best() != self._explored_from
            if self._probing:
                # a probe in which a larger budget beat the choice on this same round (paired: an easy
                # stretch lifts both sides) says the estimate is behind: probe again next round; a probe
                # that disagrees backs the schedule off, so a useless head pays O(log rounds) probes
                promising = self._probe_beat_choice(trees, accepted, self._explored_from, b)
                if changed or promising:
                    self._probe_interval = self.probe_every
                else:
                    self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
                self._next_probe_at = self._session_round + (
                    1 if promising and not changed else self._probe_interval
                )
            else:
                self._interval = (
                    self.explore_every if changed else min(2 * self._interval, self.max_explore_every)
                )
        if self._session_round >= self._next_probe_at:
            now = speeds()
            if not self._probe_target(self._best_of(now), now, b):
                # nothing above the choice that a probe could show to pay: look again one interval later
                self._next_probe_at = self._session_round + self._probe_interval
        self._round += 1
        self._session_round += 1
        self._remaining = None

    def _round_speeds(
        self, trees: list[DraftTree], accepted: list[Sequence[int]], batch: int = 1
    ) -> dict[int, float]:
        """The speed this one round (its `batch` requests) would have had at every candidate budget all
        its trees covered, against as many AR steps batched (AR itself: 1, one token per request)."""
        assert self.cost is not None
        covered = min(t.budget for t in trees)
        return {
            k: sum(accept_length_at(acc, k) for acc in accepted) / (batch * self.round_cost(k, batch))
            if k
            else 1.0
            for k in self.candidates_at(batch)
            if k <= covered
        }

    def _probe_beat_choice(
        self, trees: list[DraftTree], accepted: list[Sequence[int]], choice: int, batch: int = 1
    ) -> bool:
        """Whether, on this probe round alone, some budget above `choice` beat `choice` by `min_gain`."""
        speeds = self._round_speeds(trees, accepted, batch)
        above = [v for k, v in speeds.items() if k > choice]
        return bool(above) and max(above) > self.min_gain * speeds.get(choice, 1.0)

    # ---- reporting --------------------------------------------------------------------------------
    def predicted_speedup(self, budgets: Sequence[int], accept_lengths: Sequence[int]) -> float:
        """What the cost profile predicts for rounds played at `budgets` that committed `accept_lengths`
        tokens: tokens / cost in AR steps (the measured speedup vs AR should come out close to it)."""
        assert self.cost is not None
        cost = sum(self.cost.cost(k) for k in budgets)
        return sum(accept_lengths) / cost if cost > 0 else 0.0

    def timing_report(self) -> dict[str, dict[str, dict[str, float]]]:
        """What the clock check saw, for benchmarks and logs: per batch bucket and budget, the recent
        rounds' count and lower-median observed/profiled seconds, and the cost in use vs the profile's."""
        assert self.cost is not None, "call start(backend) first"
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (bucket, k), xs in sorted(self._times.items()):
            if not xs:
                continue
            ordered = sorted(xs)
            row = {"rounds": float(len(xs)), "observed_over_profiled": ordered[(len(xs) - 1) // 2]}
            if k:
                row["cost_profiled"] = self.cost.cost(k, bucket)
                row["cost_used"] = self.round_cost(k, bucket)
            out.setdefault(str(bucket), {})[str(k)] = row
        return out

    def describe(self) -> str:
        """One line: the expected speed of each candidate (AR = 1) and the current choice."""
        sp = self.speeds()
        line = (
            "expected speed vs AR: " + " ".join(f"{k}:{v:.2f}" for k, v in sp.items()) + f" -> {self.best()}"
        )
        ar, tree = (self._error(1, 0), self._error(1, None)) if self.check_costs else (None, None)
        if ar is not None and tree is not None:
            rounds = len(self._fresh(1, None))
            line += f"; tree rounds took {tree / ar:.2f}x the profile's cost (clock, {rounds} rounds)"
        return line
