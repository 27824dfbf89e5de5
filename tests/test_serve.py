"""`jetflow-serve` end to end: a real uvicorn server on 127.0.0.1, driven by the official `openai` client.

The server runs the shipped toy pair (the `small` target and its trained head) on the batched torch
backend. What is proved:

* lossless through HTTP: greedy tokens (the `return_token_ids` extension) and text of /v1/completions
  and /v1/chat/completions, streamed and not, equal the in-process `ARGenerator` (the target's own greedy
  decoding) and `SpeculativeGenerator` tokens of the same prompt; usage counts are those tokens;
* concurrency: requests from many client threads, held until all are queued so they really decode in
  one batch, each get exactly their own reference output;
* per-request settings reach the engine: `stop` strings cut the text (and end the engine request),
  `seed` reproduces a sampled answer, `top_k=1` sampling is greedy, `max_tokens` bounds the output;
* faults, each followed by a normal request that must still be right: malformed JSON (400), unknown model
  (404), prompt over the context window (400), `max_tokens` over the limit (400), a full queue (429 with
  Retry-After), a client that disconnects mid-stream (its request is cancelled and its KV slot freed:
  engine state asserted), a NaN from the backend (that request 500s, the ones batched with it are exact);
* /metrics counts what was served.

Determinism: no test depends on timing. Where an order of events matters, a gate in the backend holds
the engine inside a verify forward (the driver thread blocks there) until the test has set the scene.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from data_gen.toy import SMALL_HEAD_DIR, SMALL_TARGET_DIR, heldout_prompts
from jetflow_pl.chat import chat_ids, encode_prompt
from jetflow_pl.decoding import ARGenerator, SpeculativeGenerator
from jetflow_pl.head import DraftHead
from jetflow_pl.runtime.torch_backend import TorchBackend
from jetflow_pl.serve.app import ServeConfig, create_app
from jetflow_pl.serve.driver import EngineDriver
from jetflow_pl.serve.runner import ServerThread
from jetflow_pl.serve.text import TextStream
from jetflow_pl.target import TargetModel

pytestmark = pytest.mark.skipif(
    not (SMALL_HEAD_DIR / "model.safetensors").is_file(), reason="shipped toy head missing"
)

EOS = 1
MODEL = "toy-small"
MAX_NEW = 40
BUDGET = 16
#: seconds a test waits for the server to reach a state before it fails (never a timing assertion)
WAIT_S = 30.0
#: a server subprocess with `--budget auto` imports torch and measures its cost profile before /health
#: answers: ~20 s alone, over 30 s on a loaded 2-core CI machine. A liveness bound, not a speed claim.
STARTUP_S = 180.0


# ---------------------------------------------------------------------------------------------------
# backends the tests script: a gate (hold the engine inside a verify) and a NaN injector
# ---------------------------------------------------------------------------------------------------


class ScriptedBackend:
    """A `TorchBackend` whose verify forwards wait for permits (`gated`) and return NaN logits for a
    request whose prompt starts with `poison` from its second verify on (the others' logits are the
    real ones). Everything else is the real backend."""

    def __init__(
        self,
        inner: TorchBackend,
        gated: bool = False,
        poison: list[int] | None = None,
        explode: list[int] | None = None,
    ) -> None:
        self.inner = inner
        self.explode = explode  # a prompt starting with these makes its first verify raise (an engine bug)
        self.permits = threading.Semaphore(0) if gated else None
        self.poison = poison
        self._poisoned: dict[int, int] = {}  # slot -> verifies seen
        self._exploding: set[int] = set()
        self.blocked = 0  # verifies waiting at the gate now (the driver thread is inside one)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def allow(self, rounds: int) -> None:
        if self.permits is not None:
            self.permits.release(rounds)

    def open(self) -> None:
        self.allow(1_000_000)

    def _mark(self, slot: int, ids: torch.Tensor) -> None:
        ids = torch.as_tensor(ids).reshape(-1).tolist()
        if self.explode is not None and ids[: len(self.explode)] == self.explode:
            self._exploding.add(slot)
        if self.poison is not None and ids[: len(self.poison)] == self.poison:
            self._poisoned[slot] = 0

    def prefill(self, prompt_ids: torch.Tensor, slot: int = 0) -> torch.Tensor:
        self._poisoned.pop(slot, None)
        self._exploding.discard(slot)
        self._mark(slot, prompt_ids)
        return self.inner.prefill(prompt_ids, slot)

    def extend(self, slot: int, ids: torch.Tensor) -> torch.Tensor:
        if self.inner.past_length(slot) == 0:
            self._poisoned.pop(slot, None)
            self._mark(slot, ids)
        return self.inner.extend(slot, ids)

    def verify_batch(self, slots, trees):
        if self.permits is not None:
            self.blocked += 1
            opened = self.permits.acquire(timeout=WAIT_S)
            self.blocked -= 1
            if not opened:
                raise RuntimeError("the test never opened the gate")
        if self._exploding & set(slots):
            self._exploding -= set(slots)
            raise RuntimeError("injected backend failure")
        out = self.inner.verify_batch(slots, trees)
        for i, s in enumerate(slots):
            if s in self._poisoned:
                self._poisoned[s] += 1
                if self._poisoned[s] >= 2:
                    out[i] = torch.full_like(out[i], float("nan"))
        return out


# ---------------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair() -> tuple[DraftHead, TargetModel, Any]:
    head = DraftHead.from_pretrained(str(SMALL_HEAD_DIR)).eval()
    target = TargetModel.from_pretrained(SMALL_TARGET_DIR, head.config.target_layer_ids)
    return head, target, AutoTokenizer.from_pretrained(SMALL_TARGET_DIR)


@contextmanager
def serve(
    pair,
    max_batch: int = 4,
    max_queue: int | None = 64,
    gated: bool = False,
    poison: list[int] | None = None,
    max_tokens_limit: int | None = 200,
    explode: list[int] | None = None,
) -> Iterator[tuple[ServerThread, EngineDriver, ScriptedBackend]]:
    """A server on a free port of 127.0.0.1 over the toy pair (budget 16), with a scripted backend."""
    head, target, tok = pair
    backend = ScriptedBackend(TorchBackend(target, head, max_batch=max(max_batch, 2)), gated, poison, explode)
    gen = SpeculativeGenerator(backend, budget=BUDGET, width=4, eos_token_id=EOS)
    driver = EngineDriver.for_generator(gen, max_batch=max_batch, max_queue=max_queue, prefill_chunk=64)
    config = ServeConfig(MODEL, int(backend.max_positions), max_tokens_limit=max_tokens_limit)
    with ServerThread(create_app(driver, tok, config)) as srv:
        yield srv, driver, backend


@pytest.fixture(scope="module")
def server(pair):
    with serve(pair) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


@pytest.fixture(scope="module")
def chats(pair) -> list[list[dict]]:
    return [[{"role": "user", "content": r["prompt"]}] for r in heldout_prompts("math", 6)]


@pytest.fixture(scope="module")
def texts(pair, chats) -> list[str]:
    """Completion prompts: the chat-formatted text, sent raw (the toy target answers it sensibly)."""
    tok = pair[2]
    return [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]


def reference(pair, ids: list[int], max_new: int = MAX_NEW) -> list[int]:
    """The target's own greedy tokens (AR, in process); the speculative in-process run must agree."""
    head, target, _ = pair
    ar = ARGenerator(TorchBackend(target), eos_token_id=EOS).generate(ids, max_new).tokens
    spec = SpeculativeGenerator(TorchBackend(target, head), budget=BUDGET, eos_token_id=EOS)
    assert spec.generate(ids, max_new).tokens == ar
    return ar


@pytest.fixture(scope="module")
def completion_refs(pair, texts) -> list[list[int]]:
    return [reference(pair, encode_prompt(pair[2], t, chat=False)) for t in texts]


@pytest.fixture(scope="module")
def chat_refs(pair, chats) -> list[list[int]]:
    return [reference(pair, chat_ids(pair[2], c)) for c in chats]


def decode(pair, ids: list[int]) -> str:
    return pair[2].decode(ids, skip_special_tokens=True)


def finish_of(ref: list[int]) -> str:
    return "stop" if ref[-1] == EOS else "length"


def engine_state(driver: EngineDriver) -> dict:
    """The engine and its backend's KV bookkeeping, read on the driver thread between steps."""

    def snap(engine):
        backend = engine.backend.inner  # FaultGuard -> ScriptedBackend
        return {
            "idle": engine.idle,
            "active": engine.num_active,
            "waiting": engine.num_waiting,
            "free": sorted(engine._free),
            "kv_lengths": [backend.past_length(s) for s in range(engine.max_batch)],
        }

    return driver.call(snap).result(WAIT_S)


def wait_until(pred, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def wait_idle(driver: EngineDriver) -> dict:
    state = {}

    def idle():
        state.update(engine_state(driver))
        return state["idle"]

    wait_until(idle, "the engine to go idle")
    return state


def assert_serving(client: openai.OpenAI, pair, text: str, ref: list[int]) -> None:
    """The server still answers a normal request, exactly."""
    out = client.completions.create(
        model=MODEL, prompt=text, max_tokens=MAX_NEW, temperature=0, extra_body={"return_token_ids": True}
    )
    assert out.choices[0].token_ids == ref
    assert out.choices[0].text == decode(pair, ref)


def completion_tokens_stream(client: openai.OpenAI, **kw) -> tuple[str, list[int], list[Any]]:
    chunks = list(client.completions.create(stream=True, extra_body={"return_token_ids": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]
    return text, ids, chunks


# ---------------------------------------------------------------------------------------------------
# lossless through the server
# ---------------------------------------------------------------------------------------------------


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    wait_until(lambda: httpx.get(server[0].url + "/health").status_code == 200, "the driver to be ready")
    assert httpx.get(server[0].url + "/health").json() == {"status": "ok"}


def test_completions_greedy_equal_in_process(pair, client, texts, completion_refs):
    taus = []
    for text, ref in zip(texts[:3], completion_refs[:3], strict=True):
        out = client.completions.create(
            model=MODEL, prompt=text, max_tokens=MAX_NEW, temperature=0, extra_body={"return_token_ids": True}
        )
        choice = out.choices[0]
        assert choice.token_ids == ref
        assert choice.text == decode(pair, ref)
        assert choice.finish_reason == finish_of(ref)
        n_prompt = len(encode_prompt(pair[2], text, chat=False))
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n_prompt, len(ref))
        assert out.usage.total_tokens == n_prompt + len(ref)
        taus.append(out.model_extra["jetflow"]["tau"])
    # the trained head really drafted through the server: more than one token per verify on average
    assert sum(taus) / len(taus) > 1.5


def test_completions_token_id_prompt_echoes_prompt_token_ids(pair, client, texts, completion_refs):
    """Token ids in, token ids out (what regeneration through an endpoint relies on): a prompt sent as ids
    gives the same tokens as its text, and `return_token_ids` echoes the ids the engine ran on."""
    ids = encode_prompt(pair[2], texts[0], chat=False)
    kw = {"model": MODEL, "max_tokens": MAX_NEW, "temperature": 0, "extra_body": {"return_token_ids": True}}
    by_ids = client.completions.create(prompt=ids, **kw).choices[0]
    by_text = client.completions.create(prompt=texts[0], **kw).choices[0]
    assert by_ids.token_ids == by_text.token_ids == completion_refs[0]
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids == ids
    plain = client.completions.create(prompt=ids, model=MODEL, max_tokens=4, temperature=0).choices[0]
    assert "prompt_token_ids" not in plain.model_extra and "token_ids" not in plain.model_extra


def test_completions_stream_equal_in_process(pair, client, texts, completion_refs):
    for text, ref in zip(texts[3:5], completion_refs[3:5], strict=True):
        got, ids, chunks = completion_tokens_stream(
            client,
            model=MODEL,
            prompt=text,
            max_tokens=MAX_NEW,
            temperature=0,
            stream_options={"include_usage": True},
        )
        assert ids == ref and got == decode(pair, ref)
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == [finish_of(ref)]
        assert len(chunks) > 3  # streamed in pieces, not one blob
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equal_in_process(pair, client, chats, chat_refs, stream):
    for msgs, ref in zip(chats[:2], chat_refs[:2], strict=True):
        kw = {"model": MODEL, "messages": msgs, "max_tokens": MAX_NEW, "temperature": 0}
        kw["extra_body"] = {"return_token_ids": True}
        if not stream:
            out = client.chat.completions.create(**kw)
            msg = out.choices[0]
            assert msg.message.role == "assistant" and msg.message.content == decode(pair, ref)
            assert msg.token_ids == ref and msg.finish_reason == finish_of(ref)
            assert out.usage.prompt_tokens == len(chat_ids(pair[2], msgs))
            assert out.usage.completion_tokens == len(ref)
            continue
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert chunks[0].choices[0].delta.role == "assistant"
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        ids = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
        assert content == decode(pair, ref) and ids == ref
        assert chunks[-1].choices[0].finish_reason == finish_of(ref)


def test_concurrent_requests_batch_and_stay_exact(pair, texts, chats, completion_refs, chat_refs):
    """8 client threads (completions and chat, streamed and not), held at the gate until all are queued,
    so they decode as one batch of 8: each gets exactly its own reference."""
    jobs = [("completion", texts[i], completion_refs[i]) for i in range(4)]
    jobs += [("chat", chats[i], chat_refs[i]) for i in range(4)]
    with serve(pair, max_batch=8, gated=True) as (srv, driver, backend):
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)

        def run(job_index: int) -> tuple[str, list[int]]:
            kind, prompt, _ = jobs[job_index]
            stream = job_index % 2 == 1
            extra = {"return_token_ids": True}
            if kind == "completion":
                if stream:
                    text, ids, _ = completion_tokens_stream(
                        cl, model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0
                    )
                    return text, ids
                c = cl.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0, extra_body=extra
                ).choices[0]
                return c.text, c.token_ids
            kw = {"model": MODEL, "messages": prompt, "max_tokens": MAX_NEW, "temperature": 0}
            if stream:
                chunks = list(cl.chat.completions.create(stream=True, extra_body=extra, **kw))
                return (
                    "".join(c.choices[0].delta.content or "" for c in chunks),
                    [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])],
                )
            c = cl.chat.completions.create(extra_body=extra, **kw).choices[0]
            return c.message.content, c.token_ids

        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(run, i) for i in range(len(jobs))]
            # the first request(s) block the driver in their first verify; the rest wait in its inbox
            wait_until(
                lambda: backend.blocked == 1 and driver.stats.submitted + driver.pending == len(jobs),
                "all requests to reach the driver",
            )
            backend.open()
            results = [f.result(WAIT_S) for f in futures]
        for (_, _, ref), (text, ids) in zip(jobs, results, strict=True):
            assert ids == ref and text == decode(pair, ref)
        # fewer engine steps than request-rounds: rounds served several requests at once
        assert driver.stats.steps < driver.stats.rounds
        state = wait_idle(driver)
        assert state["free"] == list(range(8)) and state["kv_lengths"] == [0] * 8


# ---------------------------------------------------------------------------------------------------
# per-request settings
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text_and_ends_request(pair, server, client, texts, completion_refs, stream):
    ref_text = decode(pair, completion_refs[0])
    stop = ref_text[len(ref_text) // 4 : len(ref_text) // 4 + 3]
    want = ref_text[: ref_text.index(stop)]
    kw = {
        "model": MODEL,
        "prompt": texts[0],
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "stop": [stop, "@@never@@"],
    }
    if stream:
        got, ids, chunks = completion_tokens_stream(client, **kw)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    else:
        out = client.completions.create(extra_body={"return_token_ids": True}, **kw)
        got, ids, finish = out.choices[0].text, out.choices[0].token_ids, [out.choices[0].finish_reason]
        assert out.usage.completion_tokens == len(ids)
    assert got == want and finish == ["stop"]
    # generation ended at the token that completed the stop string (the tokens drawn after it in the same
    # round are dropped, and the engine request was cancelled), and those tokens are the reference's
    assert 0 < len(ids) < len(completion_refs[0]) and ids == completion_refs[0][: len(ids)]
    assert stop in decode(pair, ids) and stop not in decode(pair, ids[:-1])
    state = wait_idle(server[1])
    assert state["active"] == 0 and state["kv_lengths"] == [0] * len(state["kv_lengths"])


def test_seed_reproduces_and_top_k_1_is_greedy(pair, client, texts, completion_refs):
    kw = {"model": MODEL, "prompt": texts[1], "max_tokens": 24, "extra_body": {"return_token_ids": True}}
    a = client.completions.create(temperature=1.2, top_p=0.95, seed=11, **kw).choices[0].token_ids
    b = client.completions.create(temperature=1.2, top_p=0.95, seed=11, **kw).choices[0].token_ids
    assert a == b and len(a) > 0
    k1 = (
        client.completions.create(
            temperature=1.0,
            seed=3,
            model=MODEL,
            prompt=texts[1],
            max_tokens=24,
            extra_body={"return_token_ids": True, "top_k": 1},
        )
        .choices[0]
        .token_ids
    )
    assert k1 == completion_refs[1][:24]  # top-k 1 leaves the argmax only: sampling reached the engine


def test_max_tokens_bounds_and_ignore_eos(pair, client, texts, completion_refs):
    ref = completion_refs[2]
    out = client.completions.create(
        model=MODEL, prompt=texts[2], max_tokens=5, temperature=0, extra_body={"return_token_ids": True}
    ).choices[0]
    assert out.token_ids == ref[:5] and out.finish_reason == "length"
    # ignore_eos: the engine decodes past EOS to exactly max_tokens (the reference decoded without stops)
    long = client.completions.create(
        model=MODEL,
        prompt=texts[2],
        max_tokens=len(ref) + 8,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    ).choices[0]
    assert len(long.token_ids) == len(ref) + 8 and long.token_ids[: len(ref)] == ref
    assert long.finish_reason == "length"


def test_stop_token_ids_end_the_request_and_keep_the_id(pair, client, texts, completion_refs):
    """vLLM's `stop_token_ids`: the request ends at the first listed id (kept, as EOS is), finish "stop";
    EOS still stops it unless `ignore_eos` is also set."""
    ref = completion_refs[0]
    stop_id = ref[3]
    first = ref.index(stop_id)
    out = client.completions.create(
        model=MODEL,
        prompt=texts[0],
        max_tokens=len(ref) + 8,
        temperature=0,
        extra_body={"return_token_ids": True, "stop_token_ids": [stop_id]},
    ).choices[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
    # an id that never occurs changes nothing: EOS (or the length) ends it as before
    absent = next(t for t in range(pair[1].vocab_size) if t not in ref)
    same = client.completions.create(
        model=MODEL,
        prompt=texts[0],
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body={"return_token_ids": True, "stop_token_ids": [absent]},
    ).choices[0]
    assert same.token_ids == ref and same.finish_reason == finish_of(ref)
    bad = client.with_options(max_retries=0).completions.with_raw_response
    with pytest.raises(openai.BadRequestError):
        bad.create(model=MODEL, prompt=texts[0], max_tokens=4, extra_body={"stop_token_ids": [-1]})


# ---------------------------------------------------------------------------------------------------
# faults: each answered in OpenAI's error shape, and the server keeps serving
# ---------------------------------------------------------------------------------------------------


def assert_error_shape(body: dict, type_: str) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == type_ and err["message"]
    return err


def test_malformed_json_is_400(pair, server, client, texts, completion_refs):
    url = server[0].url
    for body in (b'{"model": "toy-small", "prompt": ', b"not json", b'{"model": "toy-small", "prompt": "x"'):
        r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert "not valid JSON" in assert_error_shape(r.json(), "invalid_request_error")["message"]
    # valid JSON, wrong types / missing fields: 400 naming the field
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
    assert (
        r.status_code == 400 and assert_error_shape(r.json(), "invalid_request_error")["param"] == "messages"
    )
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert_serving(client, pair, texts[0], completion_refs[0])


def test_unknown_model_is_404(pair, client, texts, completion_refs):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=4)
    err = assert_error_shape(info.value.response.json(), "invalid_request_error")
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert_serving(client, pair, texts[0], completion_refs[0])


def test_prompt_over_context_window_is_400(pair, server, client, texts, completion_refs):
    ctx = server[2].max_positions
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5] * ctx, max_tokens=1)
    err = assert_error_shape(info.value.response.json(), "invalid_request_error")
    assert err["code"] == "context_length_exceeded" and str(ctx) in err["message"]
    # fits alone, but not with its max_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5] * (ctx - 10), max_tokens=11)
    assert info.value.response.json()["error"]["param"] == "max_tokens"
    # a token id outside the vocabulary is refused by the engine itself (400, not a crash)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5, 10**6], max_tokens=2)
    assert "vocabulary" in info.value.response.json()["error"]["message"]
    assert_serving(client, pair, texts[0], completion_refs[0])


def test_max_tokens_over_limit_is_400(pair, client, texts, completion_refs):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=texts[0], max_tokens=201)  # the limit is 200
    err = assert_error_shape(info.value.response.json(), "invalid_request_error")
    assert err["param"] == "max_tokens" and "200" in err["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=201
        )
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=texts[0], max_tokens=4, n=2)
    assert info.value.response.json()["error"]["param"] == "n"
    assert_serving(client, pair, texts[0], completion_refs[0])


def test_queue_over_bound_is_429_with_retry_after(pair, texts, completion_refs):
    """One slot, a queue of one: while A decodes (held at the gate) and B waits, C is refused with 429."""
    with serve(pair, max_batch=1, max_queue=1, gated=True) as (srv, driver, backend):
        url = srv.url + "/v1/completions"
        body = {
            "model": MODEL,
            "prompt": texts[0],
            "max_tokens": MAX_NEW,
            "temperature": 0,
            "return_token_ids": True,
        }
        with ThreadPoolExecutor(3) as pool:
            a = pool.submit(httpx.post, url, json=body, timeout=WAIT_S)
            wait_until(lambda: backend.blocked == 1, "A to hold the slot (the driver inside its verify)")
            b = pool.submit(httpx.post, url, json=body, timeout=WAIT_S)
            c = pool.submit(httpx.post, url, json=body, timeout=WAIT_S)
            wait_until(lambda: driver.pending == 2, "B and C to be queued")
            backend.open()  # the driver takes B (the one waiting place) and refuses C
            ra, rb, rc = a.result(WAIT_S), b.result(WAIT_S), c.result(WAIT_S)
        # B and C raced to the inbox: exactly one of them got the waiting place
        ok, refused = (rb, rc) if rc.status_code == 429 else (rc, rb)
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        err = assert_error_shape(refused.json(), "rate_limit_error")
        assert err["code"] == "rate_limit_exceeded"
        for r in (ra, ok):
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == completion_refs[0]
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as cl:
            assert_serving(cl, pair, texts[0], completion_refs[0])
        metrics = scrape(srv.url)
        assert metrics[("jetflow_requests_total", "rejected")] == 1


def test_client_disconnect_mid_stream_cancels_and_frees_kv(pair, texts, completion_refs):
    with serve(pair, max_batch=2, gated=True) as (srv, driver, backend):
        max_tokens = 200  # with ignore_eos it would decode 200 tokens (the limit): it must be cut short
        body = {
            "model": MODEL,
            "prompt": texts[0],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        backend.allow(2)  # two rounds, then the driver blocks in the third verify
        with httpx.Client(timeout=WAIT_S) as http:
            with http.stream("POST", srv.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["text"]
            # the response is closed here: the client has gone away mid-stream
        wait_until(
            lambda: driver.pending >= 1 or driver.stats.requests.get("cancelled", 0) == 1,
            "the server to notice the disconnect",
        )
        backend.open()
        state = wait_idle(driver)
        assert driver.stats.requests.get("cancelled", 0) == 1
        assert driver.stats.tokens_generated < max_tokens  # cut short, not decoded to the end
        assert state["active"] == 0 and state["free"] == [0, 1] and state["kv_lengths"] == [0, 0]
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as cl:
            assert_serving(cl, pair, texts[0], completion_refs[0])


def test_nan_fails_only_its_request(pair, texts, completion_refs):
    """A request whose verify logits turn NaN (from its second round, batched with three others) gets a 500
    in OpenAI's error shape; the three decode on, exactly; the engine frees its slot."""
    poison = [1999, 1999, 1999]
    with serve(pair, max_batch=4, gated=True, poison=poison) as (srv, driver, backend):
        url = srv.url + "/v1/completions"
        tok = pair[2]

        def post(prompt, stream=False):
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": MAX_NEW,
                "temperature": 0,
                "return_token_ids": True,
                "stream": stream,
            }
            return httpx.post(url, json=body, timeout=WAIT_S)

        bad_prompt = poison + encode_prompt(tok, texts[3], chat=False)
        with ThreadPoolExecutor(5) as pool:
            bad = pool.submit(post, bad_prompt)
            wait_until(lambda: backend.blocked == 1, "the poisoned request to decode (inside its verify)")
            good = [pool.submit(post, texts[i]) for i in range(3)]
            wait_until(lambda: driver.pending == 3, "the others to be queued")
            backend.open()
            rbad, rgood = bad.result(WAIT_S), [g.result(WAIT_S) for g in good]
            # mid-stream, the status line is already sent: the error arrives as an SSE error event
            bad_stream = pool.submit(post, bad_prompt, True).result(WAIT_S)
        assert rbad.status_code == 500
        err = assert_error_shape(rbad.json(), "server_error")
        assert "NaN" in err["message"] and err["code"] == "numerical_error"
        for r, ref in zip(rgood, completion_refs[:3], strict=True):
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref
        events = [line[6:] for line in bad_stream.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "NaN" in json.loads(events[-2])["error"]["message"]
        state = wait_idle(driver)
        assert state["free"] == [0, 1, 2, 3] and state["kv_lengths"] == [0] * 4
        assert driver.stats.requests["error"] == 2
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as cl:
            assert_serving(cl, pair, texts[0], completion_refs[0])


def test_client_gone_before_a_non_streamed_answer_is_cancelled(pair, texts, completion_refs):
    with serve(pair, max_batch=2, gated=True) as (srv, driver, backend):
        body = {"model": MODEL, "prompt": texts[0], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while the engine is held at the gate
            httpx.post(srv.url + "/v1/completions", json=body, timeout=1.0)
        wait_until(
            lambda: driver.pending >= 1 or driver.stats.requests.get("cancelled", 0) == 1,
            "the server to notice the client is gone",
        )
        backend.open()
        state = wait_idle(driver)
        assert driver.stats.requests.get("cancelled", 0) == 1 and driver.stats.tokens_generated < 200
        assert state["free"] == [0, 1] and state["kv_lengths"] == [0, 0]
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as cl:
            assert_serving(cl, pair, texts[0], completion_refs[0])


def test_engine_failure_fails_the_requests_in_flight_and_serving_goes_on(pair, texts, completion_refs):
    """Not a NaN but an exception inside a round (a bug): the requests of that round get a 500, their slots
    are freed, and the next requests are served exactly."""
    boom = [1998, 1998]
    with serve(pair, max_batch=2, explode=boom) as (srv, driver, backend):
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"model": MODEL, "prompt": boom + [5, 6, 7], "max_tokens": 8, "temperature": 0},
            timeout=WAIT_S,
        )
        assert r.status_code == 500
        assert "injected backend failure" in assert_error_shape(r.json(), "server_error")["message"]
        state = wait_idle(driver)
        assert state["free"] == [0, 1] and state["kv_lengths"] == [0, 0]
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as cl:
            assert_serving(cl, pair, texts[0], completion_refs[0])


# ---------------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------------


def scrape(url: str) -> dict[tuple[str, str], float]:
    """{(sample name, outcome label or ""): value} of /metrics."""
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, s.labels.get("outcome", "")): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }


def test_metrics_count_what_was_served(pair, server, client, texts):
    before = scrape(server[0].url)
    used = 0
    for text in texts[:3]:
        used += client.completions.create(
            model=MODEL, prompt=text, max_tokens=MAX_NEW, temperature=0
        ).usage.completion_tokens
    for bad in ({"model": "nope", "prompt": "x"}, {"model": MODEL, "prompt": [5, 10**6], "max_tokens": 2}):
        assert httpx.post(server[0].url + "/v1/completions", json=bad).status_code in (400, 404)
    wait_idle(server[1])
    after = scrape(server[0].url)
    # each refused request counted once, as invalid (the vocabulary check is the engine's, the 404 the app's)
    assert after[("jetflow_requests_total", "invalid")] - before[("jetflow_requests_total", "invalid")] == 2
    assert after[("jetflow_requests_total", "rejected")] == before[("jetflow_requests_total", "rejected")]
    assert (
        after[("jetflow_tokens_generated_total", "")] - before[("jetflow_tokens_generated_total", "")] == used
    )
    assert after[("jetflow_requests_total", "ok")] - before[("jetflow_requests_total", "ok")] == 3
    assert after[("jetflow_queue_depth", "")] == 0 and after[("jetflow_active_requests", "")] == 0
    assert after[("jetflow_tau_mean", "")] > 1.0  # the head drafted (budget 16)
    assert after[("jetflow_tokens_per_second", "")] >= 0  # a 10 s window: its value depends on timing
    assert after[("jetflow_request_latency_seconds_count", "")] >= 3


def scrape_vllm_spec(url: str) -> dict[str, Any]:
    """vLLM's spec-decode series of /metrics: {name: value}, and the per-position vector as a list."""
    r = httpx.get(url + "/metrics")
    out: dict[str, Any] = {"per_pos": {}}
    for fam in text_string_to_metric_families(r.text):
        if not fam.name.startswith("vllm:spec_decode"):
            continue
        for s in fam.samples:
            # vLLM's labels: dashboards built for vLLM filter on model_name and engine
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0", s.labels
            if "position" in s.labels:
                out["per_pos"][int(s.labels["position"])] = s.value
            else:
                out[s.name] = s.value
    out["per_pos"] = [out["per_pos"][i] for i in sorted(out["per_pos"])]
    return out


def test_vllm_spec_decode_counters_add_up_to_the_responses(pair, server, client, texts):
    """/metrics exports vLLM's four spec-decode counters under vLLM's names and labels, and they add up to
    what the responses report: a dashboard or `vllm bench` reading them sees this server's acceptance."""
    before = scrape_vllm_spec(server[0].url)
    # every draft depth of the head is listed, as vLLM lists positions 0 .. num_speculative_tokens-1
    assert len(before["per_pos"]) == pair[0].block_size - 1
    sums = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for text in texts[:3]:
        out = client.completions.create(model=MODEL, prompt=text, max_tokens=MAX_NEW, temperature=0)
        extra = out.model_extra["jetflow"]
        for key in sums:
            sums[key] += extra[key]
        # budget 16 in every round: every round drafted, and each committed its accepted drafts + 1
        assert extra["num_drafts"] == extra["rounds"]
        assert extra["num_draft_tokens"] == BUDGET * extra["rounds"]
        committed = extra["num_accepted_tokens"] + extra["num_drafts"]
        assert committed == pytest.approx(extra["tau"] * extra["rounds"])
    wait_idle(server[1])
    after = scrape_vllm_spec(server[0].url)
    for key, total in sums.items():
        name = f"vllm:spec_decode_{key}_total"
        assert after[name] - before[name] == total, name
    per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"], strict=True)]
    # each accepted token is counted at exactly one position, and a deeper position is reached only
    # through the shallower ones
    assert sum(per_pos) == sums["num_accepted_tokens"]
    assert all(x >= y for x, y in zip(per_pos, per_pos[1:], strict=False))
    assert per_pos[0] <= sums["num_drafts"]
    # vLLM's mean acceptance length: the trained head drafted more than one token per verify
    assert 1 + sums["num_accepted_tokens"] / sums["num_drafts"] > 1.5


# ---------------------------------------------------------------------------------------------------
# text: incremental detokenization and stop strings
# ---------------------------------------------------------------------------------------------------


def stream_text(tok, ids: list[int], stop: list[str]) -> tuple[str, TextStream]:
    ts = TextStream(tok, stop)
    out = "".join(ts.push([t]) for t in ids)  # one token at a time: the worst case for held-back text
    return out + ts.finish(), ts


def test_text_stream_multibyte_and_stops(pair):
    tok = pair[2]
    text = "prix: 12€ — naïve café, ok STOP après"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    # without stops: the deltas add up to the full text, and no delta ever carried a broken character
    ts = TextStream(tok)
    deltas = [ts.push([t]) for t in ids]
    assert "".join(deltas) + ts.finish() == text and not any("\ufffd" in d for d in deltas)
    # a stop string spanning several tokens: cut before it, the tokens end with the one completing it
    got, ts = stream_text(tok, ids, ["STOP", "zzz"])
    assert got == "prix: 12€ — naïve café, ok " and ts.stopped
    assert "STOP" in tok.decode(ts.tokens) and "STOP" not in tok.decode(ts.tokens[:-1])
    # a prefix of a stop string is held back, then released when the text goes another way
    got, ts = stream_text(tok, ids, ["café!"])
    assert got == text and not ts.stopped


# ---------------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------------


def test_cli_bad_flags_are_one_line(capsys, tmp_path):
    from jetflow_pl.serve.cli import main

    assert main(["--backend", "onnxruntime"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --backend onnxruntime needs --engine-dir")
    assert main(["--head", str(SMALL_HEAD_DIR)]) == 2  # torch without a target
    assert "needs --target" in capsys.readouterr().err
    assert main(["--engine-dir", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_cli_serves_the_toy_pair(pair, tmp_path, chats, chat_refs):
    """`python -m jetflow_pl.serve` as users start it: a subprocess on a free port answers the openai
    client exactly (greedy, budget auto: the cost profile is measured into a fresh cache, in the driver
    thread) and shuts down on SIGTERM."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "jetflow_pl.serve",
        "--target",
        str(SMALL_TARGET_DIR),
        "--head",
        str(SMALL_HEAD_DIR),
        "--port",
        str(port),
        "--max-batch",
        "2",
        "--budget",
        "auto",
        "--served-model-name",
        MODEL,
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JETFLOW_PL_CACHE_DIR": str(tmp_path)}
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, "the server to come up", timeout=STARTUP_S)
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=WAIT_S) as cl:
            out = cl.chat.completions.create(
                model=MODEL,
                messages=chats[0],
                max_tokens=MAX_NEW,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
        assert out.choices[0].token_ids == chat_refs[0]
    finally:
        proc.terminate()
        # uvicorn shuts down gracefully, then re-raises the signal it caught (so a supervisor sees it)
        assert proc.wait(WAIT_S) in (0, -signal.SIGTERM)
        log.close()


@pytest.mark.slow  # exporting the toy pair to ONNX takes ~20 s on a CPU core
def test_engine_directory_is_served_one_request_at_a_time(pair, tmp_path_factory, chats, chat_refs):
    """An exported engine directory (ONNX Runtime, batch 1) behind the same API: `--max-batch 4` is
    clamped to the engine's one slot, concurrent requests queue and each is exact."""
    from export.onnx_export import ExportSettings, export_engine
    from jetflow_pl.serve.cli import build_parser, make_app

    engine_dir = export_engine(
        ExportSettings(
            head=SMALL_HEAD_DIR, target=SMALL_TARGET_DIR, out=tmp_path_factory.mktemp("eng") / "toy"
        )
    )
    args = build_parser().parse_args(
        ["--engine-dir", str(engine_dir), "--budget", "16", "--max-batch", "4", "--served-model-name", MODEL]
        + ["--threads", "1"]  # ONNX Runtime's intra-op threads
    )
    app = make_app(args)
    assert app.state.driver.engine.max_batch == 1
    with ServerThread(app) as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=WAIT_S) as cl:

            def ask(i: int) -> list[int]:
                return (
                    cl.chat.completions.create(
                        model=MODEL,
                        messages=chats[i],
                        max_tokens=MAX_NEW,
                        temperature=0,
                        extra_body={"return_token_ids": True},
                    )
                    .choices[0]
                    .token_ids
                )

            with ThreadPoolExecutor(3) as pool:
                got = list(pool.map(ask, range(3)))
    assert got == chat_refs[:3]


def test_threads_flag_is_checked():
    from jetflow_pl.serve.cli import build_parser

    assert build_parser().parse_args(["--threads", "2"]).threads == 2
    assert build_parser().parse_args([]).threads is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--threads", "0"])
