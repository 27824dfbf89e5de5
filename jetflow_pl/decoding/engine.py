"""`DecodeEngine`: continuous (in-flight) batching of requests over the one decode loop.

A server submits requests and steps the engine; every step is one scheduling round:

1. **admit** waiting requests into free slots while the KV capacity allows (a request reserves its
   prompt + `max_new_tokens` positions; one that can never fit is refused at `submit`);
2. **prefill** joining requests, in chunks of at most `prefill_chunk` prompt tokens per step, so a long
   prompt never stalls the decoding requests for more than one chunk; a request whose prompt is done
   draws its first token from the prefill logits and decodes from the next round on;
3. **decode** one round for every decoding request at once (`round.run_round`: ONE head
   forward, ONE target verify forward, each request with its own tree, KV length, acceptance, sampling
   settings and stop ids; the round's budget from the generator's policy, batch-aware for `auto`);
4. **retire** finished requests (EOS / stop id, `max_new_tokens`, the context limit, or `cancel`): their
   KV slot is freed at once and the next waiting request can take it.

API (what an OpenAI-style server needs)::

    gen = SpeculativeGenerator(load_backend("onnxruntime", engine_dir=d), budget="auto", eos_token_id=eos)
    engine = gen.engine(max_batch=8)               # or DecodeEngine(gen, max_batch=8)
    handle = engine.submit(prompt_ids, max_new_tokens=128,
                           sampling=SamplingConfig(temperature=0.7, top_p=0.9, seed=1), stop_ids=[2])
    while not handle.done:
        engine.step()                              # one round for every request in flight
        send(handle.pop_new())                     # the tokens this round produced for this request
    handle.result                                  # GenerationResult: tokens, tau, accept_lengths,
                                                   # budgets, finish_reason, latency and TTFT
    engine.cancel(handle)                          # at any time: finish_reason "cancelled", KV freed now
    for tokens in handle.stream(): ...             # or: iterate, stepping the engine as needed

`step()` returns `{request id: new tokens}` for every request that produced some. The engine is not
thread-safe: one thread steps it (a server runs it in a loop and hands tokens to its connections).
Requests never see each other: each has its own KV rows (masked from the others in every forward), its
own random generator (seeded from its `SamplingConfig`) and its own stop ids, so its tokens are those of
decoding it alone (greedy: identical; sampling: the same distribution).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from jetflow_pl.decoding.budget import LADDER_BUDGETS, AcceptanceStats
from jetflow_pl.decoding.round import GenerationResult, RoundSettings, run_round
from jetflow_pl.decoding.sampling import SamplingConfig, choose_token
from jetflow_pl.errors import UserInputError, check_finite
from jetflow_pl.runtime.backend import DecodeBackend

__all__ = ["DecodeEngine", "EngineFull", "RequestHandle"]

_TARGET_ADVICE = "a float16 overflow in the target is the usual cause; load it in bfloat16 or float32"


class EngineSettings(RoundSettings, Protocol):
    """What the engine reads of its generator: the round's settings and the check of a new request."""

    def check_prompt(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int) -> torch.Tensor: ...


class EngineFull(UserInputError):
    """The engine's queue of waiting requests is full (`max_queue`): retry later."""


@dataclass
class _Live:
    """A request in flight (engine-internal)."""

    handle: RequestHandle
    prompt: torch.Tensor
    max_new_tokens: int
    sampling: SamplingConfig
    stop_ids: frozenset[int]
    budget: int | None
    generator: torch.Generator | None
    slot: int = -1
    prefilled: int = 0  # prompt tokens already in the KV cache
    token: int = -1  # the anchor: the last committed token, not yet in the KV cache
    stats: AcceptanceStats = field(default_factory=lambda: AcceptanceStats([0]))

    @property
    def reserved(self) -> int:
        return int(self.prompt.numel()) + self.max_new_tokens

    @property
    def result(self) -> GenerationResult:
        return self.handle.result


class RequestHandle:
    """What `DecodeEngine.submit` returns: the request's tokens as they come, its stats, `cancel`."""

    def __init__(self, engine: DecodeEngine, request_id: int, result: GenerationResult) -> None:
        self.engine = engine
        self.id = request_id
        self.result = result
        self._sent = 0
        self.done = False

    @property
    def tokens(self) -> list[int]:
        return self.result.tokens

    @property
    def finish_reason(self) -> str | None:
        """None while running; then "eos" / "stop" (a stop id), "length" (max_new_tokens or the context
        limit) or "cancelled"."""
        return self.result.finish_reason if self.done else None

    def pop_new(self) -> list[int]:
        """Tokens produced since the last call (the text to stream)."""
        new = self.result.tokens[self._sent :]
        self._sent = len(self.result.tokens)
        return new

    def stream(self) -> Iterator[list[int]]:
        """Yield new tokens round by round until the request finishes, stepping the engine as needed."""
        while True:
            new = self.pop_new()
            if new:
                yield new
            if self.done:
                return
            self.engine.step()

    def cancel(self) -> None:
        self.engine.cancel(self)

    def __repr__(self) -> str:
        state = self.finish_reason or "running"
        return f"RequestHandle(id={self.id}, tokens={len(self.result.tokens)}, {state})"


class DecodeEngine:
    """Continuous batching over `generator`'s decode loop (see the module docstring).

    Args:
        generator: the `SpeculativeGenerator` whose algorithm (budget policy, tree width, fan-out policy,
            EOS ids) every request is decoded with.
        max_batch: most requests in flight at once (decoding or prefilling); at most the backend's
            `max_batch` slots (default: all of them; a one-sequence backend serves one at a time).
        prefill_chunk: prompt tokens prefilled per step (None: a whole prompt at once).
        max_kv_tokens: KV positions the requests in flight may reserve together (prompt +
            `max_new_tokens` each); None: no limit beyond the slots. A request that alone needs more is
            refused at `submit`; others wait until enough is freed.
        max_queue: most waiting requests (None: unbounded); `submit` raises `EngineFull` beyond it.
        backend: what the engine drives instead of `generator.backend` (a wrapper around it, e.g. the
            server's fault guard); the budget policy is still started on `generator.backend`.
    """

    def __init__(
        self,
        generator: EngineSettings,
        max_batch: int | None = None,
        prefill_chunk: int | None = 256,
        max_kv_tokens: int | None = None,
        max_queue: int | None = None,
        backend: DecodeBackend | None = None,
    ) -> None:
        self.generator = generator
        self.backend: DecodeBackend = generator.backend if backend is None else backend
        limit = int(self.backend.max_batch)
        if max_batch is None:
            max_batch = limit
        if not 1 <= int(max_batch) <= limit:
            raise UserInputError(
                f"max_batch must be in [1, {limit}] for {type(generator.backend).__name__} "
                f"(its request slots), got {max_batch}"
            )
        if generator.refine_factor and max_batch > 1:
            raise UserInputError("refine_factor runs one sequence at a time: use max_batch=1")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise UserInputError(f"prefill_chunk must be >= 1 (or None), got {prefill_chunk}")
        if max_kv_tokens is not None and max_kv_tokens < 1:
            raise UserInputError(f"max_kv_tokens must be >= 1 (or None), got {max_kv_tokens}")
        self.max_batch = int(max_batch)
        self.prefill_chunk = prefill_chunk
        self.max_kv_tokens = max_kv_tokens
        self.max_queue = max_queue
        self._ids = itertools.count()
        self._waiting: deque[_Live] = deque()
        self._prefilling: list[_Live] = []
        self._decoding: list[_Live] = []
        self._free = list(range(self.max_batch))
        self._started = False
        self.rounds = 0

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        stop_ids: Sequence[int] | None = None,
        budget: int | None = None,
    ) -> RequestHandle:
        """Queue a request; returns its handle at once (tokens arrive as the engine steps).

        `stop_ids`: token ids that end this request (kept in its output, like EOS); default: the
        generator's `eos_token_id`. `budget`: a fixed draft budget for this request's trees (None: the
        generator's policy). Bad input is one `UserInputError`, before anything is queued.
        """
        gen = self.generator
        prompt = gen.check_prompt(prompt_ids, max_new_tokens)
        sampling = sampling or SamplingConfig()
        if budget is not None and (int(budget) < 0 or int(budget) > gen.max_budget):
            raise UserInputError(f"budget must be in [0, {gen.max_budget}] on this backend, got {budget}")
        if budget and self.backend.block_size < 2:
            raise UserInputError("a draft budget needs a backend with a draft head (block_size >= 2)")
        need = int(prompt.numel()) + int(max_new_tokens)
        if self.max_kv_tokens is not None and need > self.max_kv_tokens:
            raise UserInputError(
                f"the request needs {need} KV positions (prompt {prompt.numel()} + max_new_tokens "
                f"{max_new_tokens}) but the engine holds at most {self.max_kv_tokens}"
            )
        if self.max_queue is not None and len(self._waiting) >= self.max_queue:
            raise EngineFull(
                f"{len(self._waiting)} requests are already waiting (max_queue={self.max_queue})"
            )
        result = GenerationResult(tokens=[])
        result.submitted_at = time.perf_counter()
        handle = RequestHandle(self, next(self._ids), result)
        stops = gen.eos_ids if stop_ids is None else frozenset(int(t) for t in stop_ids)
        live = _Live(
            handle,
            prompt,
            int(max_new_tokens),
            sampling,
            stops,
            None if budget is None else int(budget),
            None if sampling.greedy else sampling.make_generator(),
            stats=AcceptanceStats([k for k in LADDER_BUDGETS if k <= gen.max_budget]),
        )
        if max_new_tokens == 0:
            self._finish(live, "length")
        else:
            self._waiting.append(live)
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """End a request now (finish reason "cancelled"); its KV slot is freed at once."""
        for queue in (self._waiting, self._prefilling, self._decoding):
            for live in list(queue):
                if live.handle is handle:
                    queue.remove(live)
                    self._finish(live, "cancelled")
                    return

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_active(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return len(self._prefilling) + len(self._decoding)

    @property
    def idle(self) -> bool:
        return not (self._waiting or self._prefilling or self._decoding)

    # ------------------------------------------------------------------ scheduling
    def step(self) -> dict[int, list[int]]:
        """One scheduling round (admit, one prefill chunk, one decode round, retire); returns the new
        tokens of every request that produced some, by request id."""
        tracked = self._all()
        before = [len(lv.handle.result.tokens) for lv in tracked]
        if tracked:
            self.start()  # before any request's KV exists: a cost-profile measurement uses the backend
        self._admit()
        self._prefill()
        if self._decoding:
            run_round(self.generator, self.backend, self._decoding)
            self.rounds += 1
            for live in [lv for lv in self._decoding if lv.handle.result.finish_reason != "running"]:
                self._decoding.remove(live)
                self._finish(live, live.handle.result.finish_reason)
        return {
            lv.handle.id: lv.handle.result.tokens[n:]
            for lv, n in zip(tracked, before, strict=True)
            if len(lv.handle.result.tokens) > n
        }

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while not self.idle:
            self.step()

    def _all(self) -> list[_Live]:
        return [*self._waiting, *self._prefilling, *self._decoding]

    def start(self) -> None:
        """Start the budget policy once (idempotent), before the first request is prefilled: `budget="auto"`
        may measure this machine's cost profile by running the backend, which leaves slot 0's caches in
        use; they are freed before any request takes a slot (measuring between rounds corrupted live
        requests' KV). `step` calls it; call it first to keep that measurement out of a timed run."""
        if not self._started:
            self.generator.budget_policy.start(self.generator.backend, self.max_batch)
            self.backend.release(0)
            self._started = True

    def _reserved(self) -> int:
        return sum(lv.reserved for lv in (*self._prefilling, *self._decoding))

    def _admit(self) -> None:
        while self._waiting and self._free:
            live = self._waiting[0]
            if self.max_kv_tokens is not None and self._reserved() + live.reserved > self.max_kv_tokens:
                return  # the oldest waits for room (first come, first served)
            self._waiting.popleft()
            live.slot = self._free.pop(0)
            self._prefilling.append(live)

    def _prefill(self) -> None:
        """Prefill joining requests, at most `prefill_chunk` prompt tokens this step (whole prompts when
        None); a request whose prompt is done draws its first token and decodes from the next round."""
        room = self.prefill_chunk
        for live in list(self._prefilling):
            if room is not None and room <= 0:
                return
            res = live.handle.result
            total = int(live.prompt.numel())
            t0 = time.perf_counter()
            if room is None or (live.prefilled == 0 and room >= total):
                logits = self.backend.prefill(live.prompt, live.slot)
                taken = total
            else:
                if live.prefilled == 0:
                    self.backend.release(live.slot)
                taken = min(room, total - live.prefilled)
                part = live.prompt[live.prefilled : live.prefilled + taken]
                logits = self.backend.extend(live.slot, part)
            live.prefilled += taken
            if room is not None:
                room -= taken
            res.prefill_seconds += time.perf_counter() - t0
            if live.prefilled < total:
                continue
            check_finite(logits, "the target", "logits at the end of the prompt", _TARGET_ADVICE)
            live.token = choose_token(logits, live.sampling, live.generator)
            res.tokens.append(live.token)
            res.first_token_at = time.perf_counter()
            self._prefilling.remove(live)
            if live.token in live.stop_ids:
                self._finish(live, "eos" if live.token in self.generator.eos_ids else "stop")
            elif live.max_new_tokens <= 1:
                self._finish(live, "length")
            else:
                res.finish_reason = "running"
                self._decoding.append(live)

    def _finish(self, live: _Live, reason: str) -> None:
        res = live.handle.result
        res.finish_reason = reason
        res.finished_at = time.perf_counter()
        if res.first_token_at:
            res.decode_seconds = res.finished_at - res.first_token_at
        if live.slot >= 0:
            self.backend.release(live.slot)  # its KV rows are freed now
            self._free.append(live.slot)
            live.slot = -1
        live.handle.done = True
