"""Measuring a `CostProfile` through the decode loop's own round, and finding the one that applies.

`measure_cost_profile` plays real rounds (`round.run_round`, the round every generation plays) on the
backend and reads their wall time from `RoundResult.seconds`, the clock `AutoBudget` later compares
decoding rounds with: what the profile prices is exactly what decoding runs (draft of the depths the
tree can reach, tree build, verify, acceptance, commit of the accepted path).

`cost_profile_for` resolves the profile for a backend: a given file (refused with one line when it was
measured for another model or machine), else this machine's cache, else measured now (quick unless
`full`) and cached.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from jetflow_pl.decoding.budget.acceptance import AcceptanceStats
from jetflow_pl.decoding.budget.cost_profile import (
    DEFAULT_KV_LEN,
    DEFAULT_MEASURED_BATCH,
    DEFAULT_REPEATS,
    LADDER_NODES,
    QUICK_MAX_NODES,
    QUICK_REPEATS,
    CostProfile,
    CostProfileMismatch,
    cache_file,
    fingerprint,
    model_identity,
)
from jetflow_pl.decoding.budget.policy import FixedBudget, RoundResult
from jetflow_pl.decoding.round import GenerationResult, run_round
from jetflow_pl.decoding.sampling import SamplingConfig
from jetflow_pl.errors import UserInputError
from jetflow_pl.runtime.backend import DecodeBackend, max_budget, vocab_size
from jetflow_pl.tree import SCORE_QUANTUM, FanoutPolicy

__all__ = [
    "batch_sizes_for",
    "cost_profile_for",
    "isotonic",
    "ladder_for",
    "measure_cost_profile",
    "measure_rounds",
]

log = logging.getLogger(__name__)

#: a pass times up to this many pairs of rounds per tree size, enough to fill MIN_SAMPLE_SECONDS, and
#: at least MIN_PAIRS (a batched round is slow enough that the time rule alone gives one pair)
MAX_INNER_ROUNDS = 8
MIN_PAIRS = 2
MIN_SAMPLE_SECONDS = 0.03
#: most rows (B x N) of one measured round: bounds the measurement's time and memory
MAX_BATCH_TOKENS = 2048
#: untimed AR rounds after every prefill before the next timed one. The first round after a prefill pays
#: one-time work no decoding round repeats (a batch's KV group is gathered from its prefilled slots;
#: first-call allocations): on SmolLM2, torch, 16 slots, 245 ms against 127 ms for the rounds after it.
#: Timed, it fell on the AR half of a pass's first pair and made the smallest tree look free
SETTLE_ROUNDS = 1


# --------------------------------------------------------------------------------------------------
# the rounds
# --------------------------------------------------------------------------------------------------


@dataclass
class _Settings:
    """The `round.RoundSettings` a measurement plays: greedy best-first trees of `width` children, no
    stop ids, every request at its own fixed budget; `seconds` holds the last round's wall time."""

    backend: DecodeBackend
    width: int
    budget_policy: FixedBudget = field(default_factory=lambda: FixedBudget(0))
    policy: FanoutPolicy | None = None
    refine_factor: int = 0
    score_quantum: float = SCORE_QUANTUM
    eos_ids: frozenset[int] = frozenset()
    observers: list[Callable[[RoundResult], None]] = field(init=False)
    max_budget: int = field(init=False)
    seconds: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.observers = [self._timed]
        self.max_budget = max_budget(self.backend)

    def _timed(self, result: RoundResult) -> None:
        self.seconds = float(result.seconds or 0.0)


@dataclass
class _Request:
    """One measured request (`round.RoundRequest`): a slot decoding a random prompt at a fixed budget."""

    slot: int
    token: int
    budget: int = 0
    max_new_tokens: int = 1 << 30
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    generator: torch.Generator | None = None
    stop_ids: frozenset[int] = frozenset()
    stats: AcceptanceStats = field(default_factory=lambda: AcceptanceStats([0]))
    result: GenerationResult = field(default_factory=lambda: GenerationResult(tokens=[]))


class _Rounds:
    """`batch` requests in slots `0..batch-1` on a prompt of `kv_len` tokens, timed round by round.

    Every round commits what it accepts, as decoding does, so the KV length grows; once it has grown by
    `slack` positions the slots are prefilled again (untimed), which keeps every timed round within
    `slack` positions of `kv_len`."""

    def __init__(self, backend: DecodeBackend, batch: int, prompt: torch.Tensor, width: int, slack: int):
        self.backend, self.prompt, self.slack = backend, prompt, slack
        self.settings = _Settings(backend, width)
        self.requests = [_Request(slot, int(prompt[-1])) for slot in range(batch)]

    def prefill(self) -> None:
        """Start every slot over at the prompt, then play `SETTLE_ROUNDS` untimed AR rounds."""
        for r in self.requests:
            self.backend.release(r.slot)
        for r in self.requests:
            self.backend.prefill(self.prompt, r.slot)
            r.token, r.result = int(self.prompt[-1]), GenerationResult(tokens=[])
        for _ in range(SETTLE_ROUNDS):
            self.play(1)

    def play(self, nodes: int) -> float:
        """Seconds of one round whose trees have `nodes` nodes (budget `nodes - 1`)."""
        for r in self.requests:
            r.budget = nodes - 1
        run_round(self.settings, self.backend, self.requests)
        return self.settings.seconds

    def pair(self, nodes: int) -> tuple[float, float]:
        """(AR round, round of `nodes`-node trees), back to back, after a fresh prefill if the KV grew by
        `slack` positions: both verify within `slack` positions of the prompt's length."""
        grown = max(self.backend.past_length(r.slot) for r in self.requests) - len(self.prompt)
        if grown >= self.slack:
            self.prefill()
        return self.play(1), self.play(nodes)

    def release(self) -> None:
        for r in self.requests:
            self.backend.release(r.slot)


# --------------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------------


def kv_slack(kv_len: int) -> int:
    """Positions the KV may grow past `kv_len` before a measurement prefills again (`_Rounds`)."""
    return max(16, kv_len // 8)


def ladder_for(
    backend: DecodeBackend, kv_len: int, nodes: Sequence[int] = LADDER_NODES
) -> tuple[list[int], int]:
    """(tree sizes to measure, KV length): the ladder capped by the backend's tree limit and context.

    The KV length is at most half the context, and a tree must fit after it, the growth a measurement
    allows (`kv_slack`) and what the round before it may have committed (at most its own size)."""
    max_pos = int(backend.max_positions)
    kv_len = max(1, min(int(kv_len), max_pos // 2))
    room = (max_pos - kv_len - kv_slack(kv_len) - 1) // 2
    has_head = backend.block_size >= 2
    limit = max_budget(backend) + 1
    ladder = [n for n in nodes if n <= limit and n <= room and (n == 1 or has_head)]
    if not ladder or ladder[0] != 1:
        ladder = [1, *ladder]
    return ladder, kv_len


def batch_sizes_for(backend: DecodeBackend, max_batch: int | None = None) -> list[int]:
    """Batch sizes a profile of `backend` should cover: 1, then 2, 4, 8, ... and `max_batch` itself, up to
    `max_batch` (default `DEFAULT_MEASURED_BATCH`) and the backend's request slots."""
    slots = int(getattr(backend, "max_batch", 1) or 1)
    cap = min(slots, DEFAULT_MEASURED_BATCH if max_batch is None else int(max_batch))
    sizes, b = [1], 2
    while b <= cap:
        sizes.append(b)
        b *= 2
    if cap >= 2 and cap not in sizes:
        sizes.append(cap)
    return sizes


@torch.no_grad()
def measure_cost_profile(
    backend: DecodeBackend,
    kv_len: int = DEFAULT_KV_LEN,
    nodes: Sequence[int] = LADDER_NODES,
    repeats: int = DEFAULT_REPEATS,
    width: int = 4,
    seed: int = 0,
    max_batch: int | None = None,
    progress: bool = False,
) -> CostProfile:
    """Time the backend's rounds for every tree size of the ladder at every batch size of
    `batch_sizes_for(backend, max_batch)` (`measure_rounds`). `progress`: a progress bar on stderr (one
    step per pass), shown once the measurement has taken more than two seconds."""
    started = time.perf_counter()
    ladder, kv_len = ladder_for(backend, kv_len, nodes)
    sizes = batch_sizes_for(backend, max_batch)
    rows, spread = measure_rounds(
        backend, sizes, kv_len, [ladder] * len(sizes), repeats, width, seed, progress
    )
    return CostProfile(
        fingerprint=fingerprint(backend),
        batch_sizes=sizes,
        nodes=[r[0] for r in rows],
        round_s=[r[1] for r in rows],
        kv_len=kv_len,
        repeats=repeats,
        name=model_identity(backend)["name"],
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        measure_seconds=time.perf_counter() - started,
        spread=spread,
        load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    )


@torch.no_grad()
def measure_rounds(
    backend: DecodeBackend,
    batch_sizes: Sequence[int],
    kv_len: int,
    ladders: Sequence[Sequence[int]],
    repeats: int = DEFAULT_REPEATS,
    width: int = 4,
    seed: int = 0,
    progress: bool = False,
) -> tuple[list[tuple[list[int], list[float]]], float]:
    """Per batch size, (tree sizes, seconds of one round per size) over its ladder, and the samples'
    spread (median over sizes of IQR / median of the paired ratios).

    Per batch size B: slots `0..B-1` prefilled with `kv_len` seeded random tokens (token values do not
    change the cost of a forward), one warm-up pass, then `repeats` timed passes. A sample of size N is a
    pair of real rounds back to back (`round.run_round`): B AR steps, then B trees of N nodes built from
    the head's own draft (best-first, `width` children). Load on a shared machine comes in bursts that
    slow a step 10x (a descheduled intra-op thread stalls the whole op), but two rounds milliseconds
    apart mostly see the same load, so costs are medians of the paired ratios (fit non-decreasing in N)
    and t(B, 1) is the fastest AR round seen. A pass takes a few pairs per size (enough to fill
    `MIN_SAMPLE_SECONDS`, `MIN_PAIRS` to `MAX_INNER_ROUNDS`), the order of sizes alternating between
    passes. The ladder stops after the first N whose round already costs more than `block_size` AR rounds
    (no round commits more tokens per request, so no larger N can pay) and at `MAX_BATCH_TOKENS` rows.
    Leaves every slot it used released.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    from tqdm.auto import tqdm

    vocab = vocab_size(backend) or 2
    prompt = torch.randint(0, vocab, (kv_len,), generator=torch.Generator().manual_seed(seed))
    rows, spreads = [], []
    with tqdm(
        total=len(batch_sizes) * (1 + repeats),
        desc="measuring this machine's cost profile",
        unit="pass",
        delay=2,
        disable=not progress,
    ) as bar:
        for b, ladder in zip(batch_sizes, ladders, strict=True):
            rounds = _Rounds(backend, b, prompt, width, kv_slack(kv_len))
            row, spread = _measure_batch(rounds, ladder, repeats, bar.update)
            rows.append(row)
            spreads.extend(spread)
    return rows, statistics.median(spreads) if spreads else 0.0


def _measure_batch(
    rounds: _Rounds, ladder: Sequence[int], repeats: int, tick: Callable[[], Any]
) -> tuple[tuple[list[int], list[float]], list[float]]:
    """((tree sizes, round seconds), spreads) of one batch size (`measure_rounds`); `tick()` after every
    pass, the warm-up included."""
    b = len(rounds.requests)
    most_tokens = max(int(rounds.backend.block_size), 1)
    # warm-up (first-call allocations, graph caches); it also sizes how many pairs of each size a pass
    # takes, so cheap sizes get as many chances as expensive ones, and cuts the ladder
    rounds.prefill()
    t_ar = min(rounds.pair(1))
    sizes, inner = [1], {}
    for n in ladder[1:]:
        if b * n > MAX_BATCH_TOKENS:
            break
        t = rounds.pair(n)[1]
        sizes.append(n)
        inner[n] = max(MIN_PAIRS, min(MAX_INNER_ROUNDS, math.ceil(MIN_SAMPLE_SECONDS / max(t + t_ar, 1e-9))))
        if t / t_ar > 1.5 * most_tokens:  # 1.5: one slow warm-up round must not cut it short
            break
    tick()
    base: list[float] = []
    ratios: dict[int, list[float]] = {n: [] for n in sizes[1:]}
    for rep in range(repeats):
        rounds.prefill()
        for n in sizes[1:] if rep % 2 == 0 else sizes[:0:-1]:
            for _ in range(inner[n]):
                a, t = rounds.pair(n)
                base.append(a)
                ratios[n].append(t / a)
        if len(sizes) == 1:
            base.append(rounds.play(1))
        tick()
    rounds.release()
    # a round of more nodes is never cheaper: medians fit non-decreasing and >= 1, so noise cannot make a
    # large tree look cheaper than a small one (the first value stays exactly 1)
    medians = [1.0, *(max(1.0, statistics.median(ratios[n])) for n in sizes[1:])]
    spreads = [_relative_iqr(ratios[n]) for n in sizes[1:] if len(ratios[n]) >= 4]
    return (sizes, [min(base) * r for r in isotonic(medians)]), spreads


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s_, c_ = blocks.pop()
            blocks[-1][0] += s_
            blocks[-1][1] += c_
    out: list[float] = []
    for s_, c_ in blocks:
        out.extend([s_ / c_] * int(c_))
    return out


def _relative_iqr(xs: Sequence[float]) -> float:
    q = statistics.quantiles(xs, n=4)
    med = statistics.median(xs)
    return (q[2] - q[0]) / med if med > 0 else 0.0


# --------------------------------------------------------------------------------------------------
# finding the profile that applies
# --------------------------------------------------------------------------------------------------


def _complete(
    backend: DecodeBackend, prof: CostProfile, max_batch: int | None, file: Path | None
) -> CostProfile:
    """`prof` covering every batch size `batch_sizes_for(backend, max_batch)` names: the missing ones are
    measured now (at the profile's KV length, repeats and batch-1 tree sizes) and `file` re-written."""
    missing = [b for b in batch_sizes_for(backend, max_batch) if b not in prof.batch_sizes]
    if not missing:
        return prof
    log.info("cost profile %s lacks batch sizes %s: measuring them", prof.source or "(given)", missing)
    started = time.perf_counter()
    more, _ = measure_rounds(backend, missing, prof.kv_len, [prof.nodes[0]] * len(missing), prof.repeats)
    rows = dict(zip(prof.batch_sizes, zip(prof.nodes, prof.round_s, strict=True), strict=True))
    rows.update(zip(missing, more, strict=True))
    order = sorted(rows)
    prof.batch_sizes = order
    prof.nodes, prof.round_s = [rows[b][0] for b in order], [rows[b][1] for b in order]
    prof.measure_seconds += time.perf_counter() - started
    prof.__post_init__()
    prof.source = f"{prof.source} (batch sizes {missing} measured now)"
    if file is not None:
        try:
            prof.save(file)
        except OSError as err:
            log.warning("could not write the completed cost profile to %s: %s", file, err)
    return prof


def cost_profile_for(
    backend: DecodeBackend,
    path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    max_batch: int | None = None,
    full: bool = False,
    progress: bool = False,
    **measure_kw: Any,
) -> CostProfile:
    """The cost profile of `backend` on this machine: from `path`, else from the cache, else measured.

    `path` given: an existing file must match this backend's fingerprint (else `CostProfileMismatch`,
    one line naming the differing keys); a missing one is measured and written there. No `path`: the
    cached profile for this fingerprint, re-measured (and re-cached) when absent, unreadable or stale.
    `max_batch`: the most requests that will decode together (`batch_sizes_for`); batch sizes a matching
    profile lacks are measured and written back. `profile.source` says where it came from.

    A profile measured here is a quick one (`QUICK_REPEATS` passes, trees up to `QUICK_MAX_NODES`) unless
    `full`, which also replaces a quick profile found on disk by the full measurement (`DEFAULT_REPEATS`
    passes). `measure_kw` (`measure_cost_profile`'s) override both; `progress`: a progress bar on stderr.
    """
    fp = fingerprint(backend)
    quick = {"repeats": QUICK_REPEATS, "nodes": [n for n in LADDER_NODES if n <= QUICK_MAX_NODES]}
    measure_kw = {**({} if full else quick), **measure_kw, "max_batch": max_batch, "progress": progress}

    def measured(file: Path, where: str) -> CostProfile:
        prof = measure_cost_profile(backend, **measure_kw)
        kind = "quick, one pass" if prof.quick else "full"
        try:
            prof.save(file)
            prof.source = f"{file} ({where} now, {kind})"
        except OSError as err:  # a read-only home must not stop decoding: the profile is still used
            if path is not None:
                raise
            log.warning("could not cache the cost profile in %s: %s", file, err)
            prof.source = f"measured now, {kind} (not cached)"
        return prof

    if path is not None:
        path = Path(path)
        if not path.exists():
            return measured(path, "measured")
        prof = CostProfile.load(path)
        diff = prof.mismatch(fp)
        if diff:
            details = ", ".join(f"{k}: {prof.fingerprint.get(k)!r} here {fp.get(k)!r}" for k in diff)
            raise CostProfileMismatch(
                f"cost profile {path} was measured for another model or machine ({details}); "
                "delete it to re-measure, or leave out --cost-profile to use this machine's cache"
            )
        if full and prof.quick:
            return measured(path, "re-measured in full")
        return _complete(backend, prof, max_batch, path)
    file = cache_file(fp, cache_dir)
    cached = None
    if file.exists():
        try:
            cached = CostProfile.load(file)
        except UserInputError as err:
            log.info("unreadable cached cost profile (%s): re-measuring", err)
    if cached is None:
        return measured(file, "measured")
    if cached.mismatch(fp):
        log.info("cached cost profile %s does not match this machine/model: re-measuring", file)
        return measured(file, "measured")
    if full and cached.quick:
        return measured(file, "re-measured in full")
    return _complete(backend, cached, max_batch, file)
