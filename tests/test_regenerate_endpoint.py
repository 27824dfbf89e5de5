"""Regeneration through an OpenAI-compatible endpoint (data_gen/regenerate/endpoint.py).

A real `jetflow-serve` subprocess on a free port of 127.0.0.1 serves the shipped toy pair (the `small`
target and its head, speculative decoding at budget 16); the official `openai` client talks to it.
What is proved:

* exactness: greedy rows regenerated through the server (prompt ids in, response ids out) equal the
  in-process `RegenerationModule` rows of the same prompts column for column, `eos` and `length` rows
  both present; the base URL is recorded but not hashed;
* crash safety: the server SIGKILLed mid-run makes the `python -m jetflow_pl predict` command (its entry
  point, in this process) fail after its bounded retries with one `error:` line, leaving only complete
  shards; after a restart the same command resumes and the dataset holds every id once, equal to the
  in-process rows;
* the client: 429 with Retry-After, 503 and connection errors are retried with backoff (an injected
  sleep records the delays: nothing sleeps for real), exhausted retries are one clear error, a 404 /
  another model / a 400 are not retried; concurrency is bounded; each way an answer can differ from the
  in-process row is refused, and the stop-token cut matches `batched_generate`'s.

The fake endpoint for the client tests is a real HTTP server on 127.0.0.1 that plays a script.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from regen_configs import ENDPOINT, predict_run_config, predict_trainer

from data_gen.regenerate import PromptDataModule, RegenerationModule
from data_gen.regenerate.endpoint import (
    EndpointRegenerationModule,
    EndpointRegenerationWriter,
    response_tokens,
)
from data_gen.regenerate.endpoint_client import (
    Completion,
    CompletionClient,
    EndpointError,
    EndpointUnavailable,
    RequestFailed,
    RetryPolicy,
    parse_retry_after,
)
from data_gen.regenerate.prompts import collate_left
from data_gen.regenerate.writer import RegenerationWriter, list_shards, shard_ids
from data_gen.toy import SMALL_HEAD_DIR, SMALL_TARGET_DIR

pytestmark = [
    pytest.mark.skipif(
        not (SMALL_HEAD_DIR / "model.safetensors").is_file(), reason="shipped toy head missing"
    ),
    pytest.mark.filterwarnings("ignore:Couldn.t infer the batch indices"),
    pytest.mark.usefixtures("one_thread"),
]

REPO = Path(__file__).resolve().parents[1]
SOURCE = "toy:all:heldout:4"  # 12 prompts: math, code, prose
MAX_NEW = 48  # long enough for some answers to end on EOS, short enough for others to hit the length
MODEL = "small"  # jetflow-serve's default name: the target folder's
EOS = 1
#: seconds to wait for a server or a command to reach a state before failing (never a timing assertion)
WAIT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """`python -m jetflow_pl.serve` on the toy pair, in its own process (so a test can SIGKILL it)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServeProcess:
        cmd = [sys.executable, "-m", "jetflow_pl.serve", "--target", str(SMALL_TARGET_DIR), "--head"]
        cmd += [str(SMALL_HEAD_DIR), "--budget", "16", "--port", str(self.port), "--log-level", "warning"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # its log goes to a file: an unread pipe could fill up and block the server
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + WAIT_S
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"jetflow-serve exited: {self.log.read().decode()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("jetflow-serve did not become healthy")
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(WAIT_S)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    srv = ServeProcess(free_port()).start()
    yield srv
    srv.stop()


def _rows(out: Path) -> dict[str, dict]:
    import datasets

    ds = datasets.load_from_disk(str(out / "dataset"))
    rows = {r["id"]: r for r in ds}
    assert len(rows) == len(ds)  # each id once
    return rows


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The in-process greedy regeneration of SOURCE (the rows the endpoint must reproduce)."""
    tmp = tmp_path_factory.mktemp("reference")
    module = RegenerationModule(str(SMALL_TARGET_DIR), max_new_tokens=MAX_NEW)
    writer = RegenerationWriter(str(tmp / "out"), shard_size=4)
    predict_trainer(tmp, writer).predict(module, datamodule=PromptDataModule(SOURCE, batch_size=6))
    rows = _rows(tmp / "out")
    # both endings occur, so the finish-reason mapping and the stop-token rule are really compared
    assert {r["finish_reason"] for r in rows.values()} == {"eos", "length"}
    for r in rows.values():
        n_resp = len(r["input_ids"]) - r["prompt_len"]
        assert (r["input_ids"][-1] == EOS) == (r["finish_reason"] == "eos")
        assert r["finish_reason"] == "eos" or n_resp == MAX_NEW
    return rows


# ---------------------------------------------------------------------------------------------------
# through a real jetflow-serve
# ---------------------------------------------------------------------------------------------------


def test_greedy_rows_through_the_endpoint_equal_in_process(tmp_path, server, reference):
    module = EndpointRegenerationModule(
        server.base_url, str(SMALL_TARGET_DIR), model=MODEL, max_new_tokens=MAX_NEW, concurrency=4
    )
    assert module.context_length == 1024  # the server's max_model_len
    out = tmp_path / "out"
    writer = EndpointRegenerationWriter(str(out), shard_size=4)
    predict_trainer(tmp_path, writer).predict(module, datamodule=PromptDataModule(SOURCE, batch_size=6))
    rows = _rows(out)
    assert rows.keys() == reference.keys()
    for sid, ref in reference.items():
        assert rows[sid] == ref, sid  # id, domain, input_ids, loss_mask, prompt_len, response, finish_reason
    summary = json.loads((out / "summary.json").read_text())
    assert summary["written"] == len(reference) and summary["failed"] == 0
    assert summary["endpoint"]["exact"] is True and summary["endpoint"]["retries"] == 0
    assert summary["endpoint"]["requests"] == len(reference) + 1  # one GET /models, one POST per sample
    run = json.loads((out / "run.json").read_text())
    assert run["endpoint"]["base_url"] == server.base_url and run["target_path"] == f"endpoint:{MODEL}"
    # the same server under another URL is the same run (the base URL is recorded, not hashed): it resumes
    other = EndpointRegenerationModule(
        f"http://localhost:{server.port}/v1", str(SMALL_TARGET_DIR), max_new_tokens=MAX_NEW
    )
    assert other.fingerprint() == module.fingerprint()
    again = EndpointRegenerationWriter(str(out), shard_size=4)
    predict_trainer(tmp_path, again).predict(other, datamodule=PromptDataModule(SOURCE, batch_size=6))
    assert again.summary["skipped_already_done"] == len(reference) and again.summary["written"] == 0
    assert _rows(out) == rows


def test_multi_turn_rows_through_the_endpoint_equal_in_process(tmp_path, server):
    """Conversations answered turn by turn over HTTP (one request per turn, each carrying the target's own
    earlier answers as ids) give the rows the in-process loop gives, loss mask included."""
    convs = [
        {
            "id": "m1",
            "domain": "chat",
            "turns": ["Ann has 3 apples and buys 4 more. How many?", "And 2 more?"],
        },
        {"id": "m2", "domain": "chat", "system": "Be brief.", "turns": ["def add(a, b):", "Now subtract."]},
    ]
    src = tmp_path / "conv.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in convs))
    data = lambda: PromptDataModule(str(src), batch_size=2, max_turns=2)  # noqa: E731
    ref_writer = RegenerationWriter(str(tmp_path / "ref"), shard_size=4)
    predict_trainer(tmp_path, ref_writer).predict(
        RegenerationModule(str(SMALL_TARGET_DIR), max_new_tokens=MAX_NEW), datamodule=data()
    )
    module = EndpointRegenerationModule(
        server.base_url, str(SMALL_TARGET_DIR), model=MODEL, max_new_tokens=MAX_NEW, concurrency=2
    )
    writer = EndpointRegenerationWriter(str(tmp_path / "out"), shard_size=4)
    predict_trainer(tmp_path, writer).predict(module, datamodule=data())
    ref, rows = _rows(tmp_path / "ref"), _rows(tmp_path / "out")
    assert rows == ref
    for r in ref.values():  # both turns answered: two runs of 1s in the loss mask, template 0s between
        runs = "".join(map(str, r["loss_mask"][r["prompt_len"] :])).split("0")
        assert len([x for x in runs if x]) == 2, r["id"]
    assert writer.summary["turns"] == 4 and writer.summary["endpoint"]["exact"] is True


def _endpoint_config(tmp: Path, out: Path, base_url: str) -> Path:
    args = {
        "base_url": base_url,
        "model": MODEL,
        "tokenizer_path": str(SMALL_TARGET_DIR),
        "max_new_tokens": MAX_NEW,
        "concurrency": 2,
        "request_timeout_s": 30,
        "max_retries": 3,
        "backoff_s": 0.05,
        "max_backoff_s": 0.2,
    }
    cfg = predict_run_config(tmp, out, args, SOURCE, classes=ENDPOINT)
    path = tmp / "regen.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def _predict(config: Path, capsys) -> tuple[int, str, str]:
    """`python -m jetflow_pl predict --config <config>` through its entry point (`jetflow_pl.cli.main`)
    in this process: the same parser, run and error reporting, without two interpreter start-ups."""
    from jetflow_pl.cli import main

    capsys.readouterr()
    code = 0
    try:
        main(["predict", "--config", str(config)])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_server_killed_mid_run_fails_clearly_then_the_same_command_resumes(tmp_path, reference, capsys):
    srv = ServeProcess(free_port()).start()
    try:
        out = tmp_path / "out"
        config = _endpoint_config(tmp_path, out, srv.base_url)
        killed_at: list[int] = []

        def kill_after_first_shard() -> None:
            deadline = time.monotonic() + WAIT_S
            while not list_shards(out) and time.monotonic() < deadline:
                time.sleep(0.01)
            killed_at.append(len(list_shards(out)))
            srv.kill()  # the engine dies with requests in flight

        killer = threading.Thread(target=kill_after_first_shard, daemon=True)
        killer.start()
        code, _, err = _predict(config, capsys)
        killer.join(WAIT_S)
        assert killed_at and killed_at[0] >= 1  # killed after a shard landed, not before
        # after its bounded retries (4 attempts, backoff <= 0.2 s) the run stops with one line
        assert code == 2, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"error: endpoint {srv.base_url} unusable: POST /completions failed 4 times")
        assert "rerun the same command to resume" in last
        killed = list_shards(out)
        done_ids = [i for p in killed for i in shard_ids(p)]  # every shard readable
        assert 0 < len(done_ids) < len(reference)  # killed part-way
        assert not (out / "dataset").exists() and not list((out / "shards").glob(".tmp-*"))

        srv.start()  # the same port: the same command
        code, stdout, err = _predict(config, capsys)
        assert code == 0, err[-3000:]
        assert "regenerate: via " + srv.base_url in stdout
        summary = json.loads((out / "summary.json").read_text())
        assert summary["skipped_already_done"] == len(done_ids)
        assert summary["written"] == len(reference) - len(done_ids)
        all_ids = [i for p in list_shards(out) for i in shard_ids(p)]
        assert sorted(all_ids) == sorted(reference)  # each id in exactly one shard
        assert _rows(out) == reference
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------------------
# a scripted fake endpoint for the client
# ---------------------------------------------------------------------------------------------------

Reply = tuple[int, dict[str, str], Any]


@contextmanager
def fake_endpoint(script: Callable[[str, str, dict], Reply]) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 answering every request with `script(method, path, body)`."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, method: str) -> None:
            n = int(self.headers.get("content-length") or 0)
            body = json.loads(self.rfile.read(n)) if n else {}
            status, headers, payload = script(method, self.path, body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply("GET")

        def do_POST(self) -> None:
            self._reply("POST")

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()


def models_reply(names=(MODEL,)) -> Reply:
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "x", "max_model_len": 256} for n in names]
    return 200, {}, {"object": "list", "data": data}


def completion_reply(token_ids: list[int], finish: str, prompt: list[int] | None = None) -> Reply:
    choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish, "token_ids": token_ids}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    body = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL, "choices": [choice]}
    return 200, {}, body


def error_reply(status: int, message: str, headers: dict[str, str] | None = None) -> Reply:
    return status, headers or {}, {"error": {"message": message, "type": "x", "param": None, "code": None}}


class Recorder:
    """An injected `sleep` that records the delays instead of sleeping."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def test_429_with_retry_after_then_5xx_then_success(tmp_path):
    calls: list[str] = []

    def script(method, path, body):
        calls.append(f"{method} {path}")
        n = len(calls)
        if n == 1:
            return error_reply(429, "queue full", {"Retry-After": "7"})
        if n == 2:
            return error_reply(503, "warming up")
        assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 4
        assert body["return_token_ids"] is True and body["stop_token_ids"] == [EOS]
        return completion_reply([9, 8, EOS], "stop", [5, 6, 7])

    sleep = Recorder()
    policy = RetryPolicy(max_retries=3, backoff_s=0.5, max_backoff_s=30.0)
    with fake_endpoint(script) as url:
        client = CompletionClient(url, retry=policy, sleep=sleep, rng=random.Random(0))
        out = client.complete(
            MODEL, [5, 6, 7], 4, {"temperature": 0.0}, {"return_token_ids": True, "stop_token_ids": [EOS]}
        )
    assert out == Completion("", "stop", [9, 8, EOS], [5, 6, 7])
    assert calls == ["POST /v1/completions"] * 3
    assert (client.requests, client.retries) == (3, 2)
    # the 429's Retry-After (7 s) outweighs the first backoff step (0.25-0.5 s); the 503 then waits for the
    # second step, drawn from [0.5, 1.0] (equal jitter on 0.5 * 2**1)
    assert sleep.delays[0] == 7.0
    assert 0.5 <= sleep.delays[1] <= 1.0


def test_retry_delays_grow_and_are_capped():
    policy = RetryPolicy(max_retries=10, backoff_s=0.5, max_backoff_s=4.0)
    rng = random.Random(1)
    for k, step in enumerate([0.5, 1.0, 2.0, 4.0, 4.0, 4.0]):
        d = policy.delay(k, None, rng)
        assert step / 2 <= d <= step
    assert policy.delay(0, 100.0, rng) == 4.0  # an absurd Retry-After is honoured only up to the cap


def test_parse_retry_after_forms():
    assert parse_retry_after({"retry-after": "3"}) == 3.0
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "3"}) == 0.25
    now = 1_000_000.0
    assert parse_retry_after({"retry-after": formatdate(now + 12, usegmt=True)}, now=now) == 12.0
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({}) is None


def test_exhausted_retries_and_a_dead_port_are_one_clear_error():
    sleep = Recorder()
    policy = RetryPolicy(max_retries=2, backoff_s=0.1, max_backoff_s=1.0)
    with fake_endpoint(lambda m, p, b: error_reply(503, "engine stopped")) as url:
        client = CompletionClient(url, retry=policy, sleep=sleep)
        with pytest.raises(EndpointUnavailable) as info:
            client.complete(MODEL, [5], 4, {}, {})
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"endpoint {url} unusable: POST /completions failed 3 times")
    assert "HTTP 503: engine stopped" in msg and "rerun the same command to resume" in msg
    assert len(sleep.delays) == 2 and client.requests == 3

    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    client = CompletionClient(dead, retry=policy, sleep=Recorder())
    with pytest.raises(EndpointUnavailable, match="GET /models failed 3 times .*APIConnectionError"):
        client.resolve_model(MODEL)


def test_wrong_model_404_and_400_are_not_retried():
    replies = {"GET /v1/models": models_reply(["other-model"])}

    def script(method, path, body):
        if f"{method} {path}" in replies:
            return replies[f"{method} {path}"]
        if body["prompt"] == [1]:
            return error_reply(404, "The model `x` does not exist.")
        return error_reply(400, "the prompt is too long")

    sleep = Recorder()
    with fake_endpoint(script) as url:
        client = CompletionClient(url, retry=RetryPolicy(max_retries=5), sleep=sleep)
        with pytest.raises(EndpointError, match=r"serves \['other-model'\], not 'small'"):
            client.resolve_model(MODEL)
        assert client.resolve_model(None)["id"] == "other-model"  # its only model
        with pytest.raises(EndpointError, match="answered HTTP 404.*not served there") as info:
            client.complete(MODEL, [1], 4, {}, {})
        assert not isinstance(info.value, RequestFailed)  # fatal: every sample would fail the same way
        with pytest.raises(RequestFailed, match="HTTP 400: the prompt is too long"):
            client.complete(MODEL, [2], 4, {}, {})
        with pytest.raises(EndpointError, match="serves"):
            EndpointRegenerationModule(url, str(SMALL_TARGET_DIR), model=MODEL)
    assert sleep.delays == [] and client.requests == 4


def _batch(module, prompts: list[list[int]]) -> dict:
    from data_gen.regenerate.prompts import PromptItem

    items = [PromptItem(id=f"s{i}", domain="math", prompt_ids=p) for i, p in enumerate(prompts)]
    return collate_left(items, pad_id=0)


def test_concurrency_is_bounded_and_on_error_skip_fails_only_that_sample():
    concurrency, n = 3, 9
    lock = threading.Lock()
    state = {"in_flight": 0, "max": 0}
    barrier = threading.Barrier(concurrency, timeout=WAIT_S)

    def script(method, path, body):
        if method == "GET":
            return models_reply()
        with lock:
            state["in_flight"] += 1
            state["max"] = max(state["max"], state["in_flight"])
        try:
            if body["prompt"][0] != 99:  # all but the refused sample wait until `concurrency` are in
                barrier.wait()
            return (
                error_reply(400, "refused") if body["prompt"][0] == 99 else completion_reply([7, EOS], "stop")
            )
        finally:
            with lock:
                state["in_flight"] -= 1

    with fake_endpoint(script) as url:
        module = EndpointRegenerationModule(
            url,
            str(SMALL_TARGET_DIR),
            model=MODEL,
            max_new_tokens=4,
            concurrency=concurrency,
            on_error="skip",
        )
        assert module.context_length == 256
        prompts = [[10 + i, 11] for i in range(n)] + [[99, 11]]
        out = module.predict_step(_batch(module, prompts))
        module.on_predict_end()
    # `concurrency` requests were in flight together (the barrier opened) and never more
    assert state["max"] == concurrency
    assert [r["id"] for r in out["records"]] == [f"s{i}" for i in range(n)]
    assert all(r["response_ids"] == [7, EOS] and r["finish_reason"] == "eos" for r in out["records"])
    assert out["failed"] == [
        {"id": f"s{n}", "error": f"endpoint {url} refused POST /completions (HTTP 400: refused)"}
    ]
    assert out["new_tokens"] == 2 * n


# ---------------------------------------------------------------------------------------------------
# an answer -> the row's response ids and finish reason, as batched_generate ends them
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMALL_TARGET_DIR)


def test_response_tokens_end_rows_as_in_process(tokenizer):
    prompt, stop = [5, 6], [EOS, 3]

    def resp(ids, finish, mode="token_ids", prompt_ids=None, text=""):
        return response_tokens(Completion(text, finish, ids, prompt_ids), prompt, stop, 4, mode, tokenizer)

    assert resp([9, EOS], "stop") == ([9, EOS], "eos")  # the stop token stays in the row
    assert resp([9, 3], "stop") == ([9, 3], "eos")  # any id of the stop set
    assert resp([9, 9, 9, 9], "length") == ([9, 9, 9, 9], "length")
    assert resp([9, 9, 9, EOS], "length") == ([9, 9, 9, EOS], "eos")  # a stop id as the last allowed token
    # a server that ignores stop_token_ids runs on: the row is cut at the first stop id
    assert resp([9, 3, 8, 8], "length") == ([9, 3], "eos")
    assert resp([9, EOS], "stop", prompt_ids=prompt) == ([9, EOS], "eos")
    with pytest.raises(RequestFailed, match="other prompt ids"):
        resp([9, EOS], "stop", prompt_ids=[6])
    with pytest.raises(RequestFailed, match="not a stop id of this run"):
        resp([9, 2], "stop")  # the server stopped on an id this run does not stop on
    with pytest.raises(RequestFailed, match="capped max_tokens"):
        resp([9, 9], "length")
    with pytest.raises(RequestFailed, match="more than max_tokens"):
        resp([9, 9, 9, 9, 9], "length")
    with pytest.raises(EndpointError, match="no token ids.*response_ids: text"):
        resp(None, "stop")
    # text fallback: re-tokenized, the dropped EOS put back on a "stop"
    ids = tokenizer.encode("12 + 30 = 42", add_special_tokens=False)
    assert resp(None, "stop", mode="text", text="12 + 30 = 42") == ([*ids, EOS], "eos")
    assert resp(None, "length", mode="text", text="12 + 30 = 42") == (ids, "length")


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_shipped_endpoint_config_parses(capsys):
    from jetflow_pl.cli import lightning_main

    with pytest.raises(SystemExit) as info:
        lightning_main(
            ["predict", "--config", str(REPO / "configs/regenerate/endpoint.yaml"), "--print_config"]
        )
    assert info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "data_gen.regenerate.endpoint.EndpointRegenerationModule" in printed
    assert "data_gen.regenerate.endpoint.EndpointRegenerationWriter" in printed
