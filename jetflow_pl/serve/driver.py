"""`EngineDriver`: the one thread that owns the model and steps the `DecodeEngine`.

The engine is not thread-safe and every model call blocks, so neither may happen on the server's event
loop. The driver runs the engine in one background thread; the HTTP handlers talk to it only through a
thread-safe inbox (submit, cancel, call) and receive each request's events on an `asyncio.Queue` of
their own, fed with `loop.call_soon_threadsafe`:

    ("accepted",)                      the engine queued it (first event; or ("error", exc) instead)
    ("tokens", [ids])                  new tokens after a step
    ("done", finish_reason, result)    the request ended (eos / stop / length / cancelled)
    ("error", exc)                     it failed (a NaN in its outputs, or the engine failed)

Each loop iteration drains the inbox (so submits and cancels take effect between rounds, never inside
one), steps the engine once, fails the requests whose outputs were not finite (`faults.FaultGuard`) and
hands out the new tokens. With nothing in flight it sleeps on the inbox.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from jetflow_pl.decoding.engine import DecodeEngine, EngineFull, RequestHandle
from jetflow_pl.decoding.sampling import SamplingConfig
from jetflow_pl.errors import NumericalError
from jetflow_pl.serve.faults import FaultGuard

__all__ = ["DriverStats", "EngineDriver", "SpecDecodeCounts", "Ticket", "spec_decode_counts"]

log = logging.getLogger(__name__)

#: seconds over which the tokens/s gauge is averaged
RATE_WINDOW_S = 10.0


class Ticket:
    """One request as the HTTP side holds it: its event queue and, once submitted, the engine handle
    (touched on the driver thread only)."""

    _ids = itertools.count()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.id = next(self._ids)
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.handle: RequestHandle | None = None
        self.finished = False  # set on the event loop once a terminal event was read
        #: why the HTTP side cancelled it ("stop": its stop string was seen, a normal end; "disconnect")
        self.cancel_reason: str | None = None

    def _emit(self, *event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed (server shut down): nobody is listening
            pass


@dataclass
class SpecDecodeCounts:
    """vLLM's spec-decode counts (its `SpecDecodingStats`) of a set of rounds; see `spec_decode_counts`."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: accepted_per_pos[i]: drafts whose accepted path reached draft depth i + 1
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, other: SpecDecodeCounts) -> None:
        """Add `other`'s counts to these (in place)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.accepted_per_pos.extend([0] * max(len(other.accepted_per_pos) - len(self.accepted_per_pos), 0))
        for i, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += n


def spec_decode_counts(budgets: list[int], accept_lengths: list[int]) -> SpecDecodeCounts:
    """vLLM's meaning of one request's rounds (`budgets[i]`, `accept_lengths[i]` per round).

    A round that drafted (budget > 0; an AR round drafts nothing and is no draft) is one draft of `budget`
    draft tokens (every node of the tree was drafted) of which `accept_length - 1` were accepted (the last
    committed token is the target's own, vLLM's "bonus"); `accepted_per_pos[i]` counts the drafts whose
    accepted path reached depth `i + 1`. So `1 + num_accepted_tokens / num_drafts` is vLLM's mean
    acceptance length over the drafted rounds.
    """
    out = SpecDecodeCounts()
    for budget, committed in zip(budgets, accept_lengths, strict=True):
        if budget <= 0:
            continue
        accepted = max(int(committed) - 1, 0)
        out.num_drafts += 1
        out.num_draft_tokens += int(budget)
        out.num_accepted_tokens += accepted
        out.accepted_per_pos.extend([0] * max(accepted - len(out.accepted_per_pos), 0))
        for i in range(accepted):
            out.accepted_per_pos[i] += 1
    return out


@dataclass
class DriverStats:
    """What /metrics reports; written on the driver thread, read under `lock` by the scraper."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: dict[str, int] = field(default_factory=dict)  # outcome -> count
    submitted: int = 0  # submissions the driver has taken from its inbox
    tokens_generated: int = 0
    rounds: int = 0  # request-rounds: one per request per decode round
    committed_in_rounds: int = 0  # tokens those rounds committed (tau = this / rounds)
    budget_sum: int = 0  # draft budgets those rounds were played at (0: AR rounds)
    #: vLLM's spec-decode counters over every finished request (`spec_decode_counts`)
    spec: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    latency_sum_s: float = 0.0
    ttft_sum_s: float = 0.0
    latency_count: int = 0
    queue_depth: int = 0
    active: int = 0
    steps: int = 0
    _recent: deque = field(default_factory=deque)  # (time, tokens) of recent steps

    def count(self, outcome: str) -> None:
        with self.lock:
            self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def tokens_per_s(self, now: float | None = None) -> float:
        """Tokens generated per second over the last `RATE_WINDOW_S` seconds."""
        now = time.monotonic() if now is None else now
        with self.lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    @property
    def tau(self) -> float:
        return self.committed_in_rounds / self.rounds if self.rounds else 0.0


class EngineDriver:
    """Owns `engine` and steps it in a daemon thread; see the module docstring.

    Build it from a generator with `EngineDriver.for_generator(gen, max_batch=..., max_queue=...)` (the
    engine gets the `FaultGuard`), `start()` it, and `stop()` it on shutdown.
    """

    def __init__(self, engine: DecodeEngine, guard: FaultGuard | None = None) -> None:
        self.engine = engine
        self.guard = guard
        self.stats = DriverStats()
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[int, Ticket] = {}  # ticket id -> ticket, submitted and not finished
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()

    @classmethod
    def for_generator(cls, generator: Any, **engine_kwargs: Any) -> EngineDriver:
        """A driver over `generator.engine(**engine_kwargs)` with a `FaultGuard` around its backend."""
        guard = FaultGuard(generator.backend)
        driver = cls(DecodeEngine(generator, backend=guard, **engine_kwargs), guard)
        guard.locate = driver._request_at
        return driver

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="jetflow-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop; requests still in flight get an error event."""
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ thread-safe entry points
    def submit(
        self,
        ticket: Ticket,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingConfig,
        stop_ids: Sequence[int] | None = None,
    ) -> None:
        """Queue a request; its first event says whether the engine took it."""
        self._inbox.put(("submit", ticket, list(prompt_ids), int(max_new_tokens), sampling, stop_ids))

    def cancel(self, ticket: Ticket, reason: str = "disconnect") -> None:
        """End `ticket`'s request (`reason`: "disconnect", the client went away, or "stop", its stop
        string was seen): its KV is freed at once."""
        if ticket.cancel_reason is None:
            ticket.cancel_reason = reason
        self._inbox.put(("cancel", ticket))

    def call(self, fn: Callable[[DecodeEngine], Any]) -> Future:
        """Run `fn(engine)` on the driver thread between steps (a consistent view of the engine)."""
        fut: Future = Future()
        self._inbox.put(("call", fn, fut))
        return fut

    @property
    def pending(self) -> int:
        """Commands in the inbox not yet taken by the driver."""
        return self._inbox.qsize()

    # ------------------------------------------------------------------ the loop (driver thread)
    @property
    def ready(self) -> bool:
        """The loop runs and the budget policy has started (`auto`: the cost profile is loaded or measured)."""
        return self._ready.is_set() and self.alive

    def _warm(self) -> None:
        """Start the budget policy before the first request. `budget="auto"` without a cached cost profile
        measures one through the backend; done inside a step (`DecodeEngine._start`, after that step's
        prefill) the measurement would run over the KV of the requests just prefilled, so it is done here,
        with nothing in flight, which also keeps the measurement out of the first request's latency."""
        try:
            self.engine.start()
        except Exception:  # the engine retries at its first round, where the request then fails
            log.exception("starting the budget policy failed")
        self._ready.set()

    def _loop(self) -> None:
        try:
            self._warm()
            while not self._stop.is_set():
                self._drain(block=self.engine.idle)
                if self._stop.is_set():
                    break
                if not self.engine.idle:
                    self._step()
        finally:
            gone = RuntimeError("the server is shutting down")
            for ticket in list(self._live.values()):
                ticket._emit("error", gone)
            self._live.clear()
            while True:  # submissions never taken: answer them too, so no handler waits forever
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "submit":
                    cmd[1]._emit("error", gone)
                elif cmd[0] == "call":
                    cmd[2].set_exception(gone)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run_command(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._publish_gauges()

    def _run_command(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "submit":
            _, ticket, prompt, max_new, sampling, stop_ids = cmd
            with self.stats.lock:
                self.stats.submitted += 1
            try:
                ticket.handle = self.engine.submit(prompt, max_new, sampling, stop_ids=stop_ids)
            except Exception as err:  # EngineFull, UserInputError: the handler maps them to a status
                if isinstance(err, EngineFull):  # a 429 (other refusals are 4xx: the app counts those)
                    self.stats.count("rejected")
                ticket._emit("error", err)
                return
            self._live[ticket.id] = ticket
            ticket._emit("accepted")
            self._deliver(ticket)  # max_new_tokens == 0 finishes at once
        elif kind == "cancel":
            ticket = cmd[1]
            if ticket.id in self._live and ticket.handle is not None:
                self.engine.cancel(ticket.handle)
                self._deliver(ticket)
        elif kind == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.engine))
            except Exception as err:
                fut.set_exception(err)

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as err:
            # not a per-request NaN (the guard catches those): the engine's state is unknown, so every
            # request in flight is failed and cancelled, and the server goes on with new ones
            log.exception("engine step failed; failing the %d requests in flight", len(self._live))
            for ticket in list(self._live.values()):
                self._fail(ticket, err)
            return
        faults = self.guard.take_faults() if self.guard is not None else {}
        if faults:
            by_handle = {t.handle.id: t for t in self._live.values() if t.handle is not None}
            for handle_id, message in faults.items():
                ticket = by_handle.get(handle_id)
                if ticket is not None:
                    self._fail(ticket, NumericalError(message))
        with self.stats.lock:
            self.stats.steps += 1
        for ticket in list(self._live.values()):
            self._deliver(ticket)
        self._publish_gauges()

    def _request_at(self, slot: int) -> int | None:
        """The engine handle id of the request holding `slot` now (called by the guard mid-step, on this
        thread; the engine's own record of who sits where)."""
        for live in (*self.engine._prefilling, *self.engine._decoding):
            if live.slot == slot:
                return live.handle.id
        return None

    def _fail(self, ticket: Ticket, err: BaseException) -> None:
        if ticket.handle is not None and not ticket.handle.done:
            self.engine.cancel(ticket.handle)  # frees its slot and KV now
        self._live.pop(ticket.id, None)
        self.stats.count("error")
        ticket._emit("error", err)

    def _deliver(self, ticket: Ticket) -> None:
        handle = ticket.handle
        new = handle.pop_new()
        if new:
            with self.stats.lock:
                self.stats.tokens_generated += len(new)
                self.stats._recent.append((time.monotonic(), len(new)))
            ticket._emit("tokens", new)
        if handle.done:
            self._live.pop(ticket.id, None)
            res = handle.result
            ok = res.finish_reason != "cancelled" or ticket.cancel_reason == "stop"
            with self.stats.lock:
                self.stats.rounds += res.num_rounds
                self.stats.committed_in_rounds += sum(res.accept_lengths)
                self.stats.budget_sum += sum(res.budgets)
                self.stats.spec.add(spec_decode_counts(res.budgets, res.accept_lengths))
                if ok and res.finished_at:
                    self.stats.latency_sum_s += res.latency_s
                    self.stats.ttft_sum_s += res.ttft_s
                    self.stats.latency_count += 1
            self.stats.count("ok" if ok else "cancelled")
            ticket._emit("done", handle.finish_reason, res)

    def _publish_gauges(self) -> None:
        with self.stats.lock:
            self.stats.queue_depth = self.engine.num_waiting + self._inbox.qsize()
            self.stats.active = self.engine.num_active
