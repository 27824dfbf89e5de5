"""`create_app(driver, tokenizer, config)`: the OpenAI-compatible FastAPI app over an `EngineDriver`.

Handlers never touch the model: they tokenize, validate, submit to the driver and await the request's
events (`driver.Ticket`). A request is checked before it is queued (model name, unsupported parameters,
prompt length against the context window, `max_tokens` against the server's limit) and refused with
OpenAI's error JSON; the engine's own refusals come back as the ticket's first event (a full queue ->
429 with `Retry-After`, anything else it refuses -> 400). Streams are SSE in OpenAI's chunk format ending
with `data: [DONE]`; when the client goes away mid-stream (Starlette cancels the response) the request is
cancelled in the engine at once, which frees its KV slot. A request whose outputs turn NaN fails alone
with a 500 (`faults.FaultGuard`); mid-stream, where the status is already sent, as an error chunk.

Extensions, as vLLM spells them: `top_k`, `ignore_eos`, `stop_token_ids` (more ids that end a request),
`return_token_ids` (the generated ids on each choice/chunk: the lossless check through the server; a
non-streamed completion also echoes the `prompt_token_ids` the engine ran on), and a `jetflow` object on
non-streamed responses (tau, rounds, TTFT and latency of the request).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jetflow_pl.chat import chat_ids, encode_prompt
from jetflow_pl.decoding.engine import EngineFull
from jetflow_pl.decoding.sampling import SamplingConfig
from jetflow_pl.errors import NumericalError, UserInputError
from jetflow_pl.serve import protocol as P
from jetflow_pl.serve.driver import EngineDriver, Ticket, spec_decode_counts
from jetflow_pl.serve.metrics import CONTENT_TYPE, metrics_registry, render
from jetflow_pl.serve.text import TextStream

__all__ = ["ServeConfig", "create_app"]

#: seconds between checks that a client waiting for a non-streamed answer is still there
DISCONNECT_POLL_S = 0.5


@dataclass
class ServeConfig:
    """What the app needs to know besides the driver and the tokenizer.

    context_window: the backend's `max_positions` (prompt + max_tokens must fit).
    max_tokens_limit: the most `max_tokens` one request may ask for (None: the context window).
    default_max_tokens: a chat request's `max_tokens` when it gives none (capped by the context left).
    retry_after_s: the `Retry-After` of a 429.
    """

    model_name: str
    context_window: int
    max_tokens_limit: int | None = None
    default_max_tokens: int = 256
    retry_after_s: int = 1
    owned_by: str = "jetflow_pl"


def _error_response(err: P.ServeError) -> JSONResponse:
    return JSONResponse(
        P.error_body(err.message, err.type, err.param, err.code), status_code=err.status, headers=err.headers
    )


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def create_app(
    driver: EngineDriver, tokenizer: Any, config: ServeConfig, manage_driver: bool = True
) -> FastAPI:
    """The app; with `manage_driver` it starts the driver at startup and stops it at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_driver:
            driver.start()
        try:
            yield
        finally:
            if manage_driver:
                driver.stop()

    app = FastAPI(title="jetflow-serve", lifespan=lifespan)
    app.state.driver = driver
    app.state.config = config
    registry = metrics_registry(
        driver.stats, config.model_name, positions=max(driver.engine.backend.block_size - 1, 0)
    )

    @app.exception_handler(P.ServeError)
    async def _serve_error(request: Request, err: P.ServeError) -> JSONResponse:
        if err.status < 500 and err.status != 429:
            driver.stats.count("invalid")
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        """Malformed JSON or a field of the wrong type/range: 400 (FastAPI's default is 422)."""
        driver.stats.count("invalid")
        errors = err.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            msg = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return _error_response(P.ServeError(400, msg))
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return _error_response(P.ServeError(400, msg, param=param))

    # ------------------------------------------------------------------ info endpoints
    @app.get("/health")
    async def health() -> Response:
        if not driver.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if not driver.ready:  # e.g. measuring this machine's cost profile (budget auto): not yet in rotation
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": config.owned_by,
                    "max_model_len": config.context_window,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(registry), media_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ generation
    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        _check_common(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise P.ServeError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = _tokenize(lambda: encode_prompt(tokenizer, prompt, chat=False))
        else:
            ids = [int(t) for t in prompt]
        return await _generate(body, ids, body.max_tokens, chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        _check_common(body)
        ids = _tokenize(lambda: chat_ids(tokenizer, body.chat(), hint="use /v1/completions with raw text"))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await _generate(body, ids, max_tokens, chat=True, request=request)

    def _check_common(body: P._Sampling) -> None:
        if body.model != config.model_name:
            raise P.ServeError(
                404,
                f"the model {body.model!r} does not exist; this server serves {config.model_name!r}",
                param="model",
                code="model_not_found",
            )
        bad = body.unsupported()
        if bad is not None:
            raise P.ServeError(400, bad[1], param=bad[0])

    def _tokenize(fn) -> list[int]:
        try:
            return list(fn())
        except UserInputError as err:
            raise P.ServeError(400, str(err), param="messages") from err

    def _limits(n_prompt: int, max_tokens: int | None) -> int:
        ctx = config.context_window
        if n_prompt == 0:
            raise P.ServeError(400, "the prompt is empty", param="prompt")
        if n_prompt >= ctx:
            raise P.ServeError(
                400,
                f"the prompt has {n_prompt} tokens; this model's context window is {ctx} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(config.default_max_tokens, ctx - n_prompt)
        limit = config.max_tokens_limit
        if limit is not None and max_tokens > limit:
            raise P.ServeError(
                400, f"max_tokens is {max_tokens}; this server allows at most {limit}", param="max_tokens"
            )
        if n_prompt + max_tokens > ctx:
            raise P.ServeError(
                400,
                f"the prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds this model's context "
                f"window of {ctx} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def _stop_ids(body: P._Sampling) -> list[int] | None:
        """The request's stop ids for the engine: None = its default (EOS); `ignore_eos` drops EOS,
        `stop_token_ids` adds to whichever of the two applies."""
        extra = [int(t) for t in body.stop_token_ids or ()]
        if not body.ignore_eos and not extra:
            return None
        eos = [] if body.ignore_eos else sorted(driver.engine.generator.eos_ids)
        return eos + [t for t in extra if t not in eos]

    async def _generate(
        body: P._Sampling, ids: list[int], max_tokens: int | None, chat: bool, request: Request
    ) -> Response:
        max_tokens = _limits(len(ids), max_tokens)
        try:
            sampling = SamplingConfig(body.temperature, body.top_k, body.top_p, body.seed)
        except ValueError as err:
            raise P.ServeError(400, str(err)) from err
        ticket = Ticket(asyncio.get_running_loop())
        driver.submit(ticket, ids, max_tokens, sampling, stop_ids=_stop_ids(body))
        first = await ticket.events.get()
        if first[0] == "error":
            raise _map_error(first[1])
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        text = TextStream(tokenizer, body.stop_strings())
        if body.stream:
            return StreamingResponse(
                _stream(ticket, text, rid, chat, len(ids), body),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _collect(ticket, text, rid, chat, ids, body, request)

    def _map_error(err: BaseException) -> P.ServeError:
        if isinstance(err, EngineFull):
            return P.ServeError(
                429,
                f"the server is at capacity ({err}); retry after {config.retry_after_s} s",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(config.retry_after_s)},
            )
        if isinstance(err, UserInputError):
            return P.ServeError(400, str(err))
        if isinstance(err, NumericalError):
            return P.ServeError(500, str(err), type="server_error", code="numerical_error")
        return P.ServeError(500, f"{type(err).__name__}: {err}", type="server_error")

    async def _collect(
        ticket: Ticket,
        text: TextStream,
        rid: str,
        chat: bool,
        prompt: list[int],
        body: P._Sampling,
        request: Request,
    ) -> Response:
        reason, result = None, None
        try:
            while True:
                try:
                    event = await asyncio.wait_for(ticket.events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        driver.cancel(ticket, "disconnect")
                        return Response(status_code=499)
                    continue
                if event[0] == "tokens":
                    text.push(event[1])
                    if text.stopped:
                        driver.cancel(ticket, "stop")
                        break
                elif event[0] == "done":
                    reason, result = event[1], event[2]
                    text.finish()
                    break
                else:
                    raise _map_error(event[1])
        finally:
            ticket.finished = True
        finish = P.openai_finish_reason(reason, text.stopped)
        use = P.usage(len(prompt), len(text.tokens))
        extra = {"jetflow": _stats(result)} if result is not None else {}
        ids = list(text.tokens) if body.return_token_ids else None
        if chat:
            return JSONResponse(P.chat_body(rid, config.model_name, text.text, finish, use, extra, ids))
        prompt_ids = prompt if body.return_token_ids else None
        return JSONResponse(
            P.completion_body(rid, config.model_name, text.text, finish, use, extra, ids, prompt_ids)
        )

    async def _stream(
        ticket: Ticket, text: TextStream, rid: str, chat: bool, n_prompt: int, body: P._Sampling
    ) -> AsyncIterator[str]:
        model = config.model_name
        want_ids = body.return_token_ids

        def chunk(delta: str, finish: str | None = None, ids: list[int] | None = None) -> str:
            if want_ids and ids is None:
                ids = []  # with return_token_ids every content chunk carries the field
            if chat:
                d = {"content": delta} if delta or finish is None else {}
                return _sse(P.chat_chunk(rid, model, d, finish, ids))
            return _sse(P.completion_chunk(rid, model, delta, finish, ids))

        done = False
        try:
            if chat:
                yield _sse(P.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
            reason = None
            while True:
                event = await ticket.events.get()
                if event[0] == "tokens":
                    seen = len(text.tokens)
                    delta = text.push(event[1])
                    if delta or want_ids:  # the ids kept by `push` (none past a stop string)
                        yield chunk(delta, ids=text.tokens[seen:] if want_ids else None)
                    if text.stopped:
                        driver.cancel(ticket, "stop")
                        break
                elif event[0] == "done":
                    reason = event[1]
                    tail = text.finish()
                    if tail:
                        yield chunk(tail)
                    break
                else:  # the status line is sent: the error goes in the stream, as OpenAI-compatible servers do
                    err = _map_error(event[1])
                    done = True
                    yield _sse(P.error_body(err.message, err.type, err.param, err.code))
                    yield _sse("[DONE]")
                    return
            yield chunk("", P.openai_finish_reason(reason, text.stopped))
            if body.include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _sse(P.usage_chunk(rid, model, obj, P.usage(n_prompt, len(text.tokens))))
            done = True
            yield _sse("[DONE]")
        finally:
            ticket.finished = True
            if not done:  # the client went away (Starlette cancelled us): free its slot now
                driver.cancel(ticket, "disconnect")

    return app


def _stats(result: Any) -> dict:
    counts = spec_decode_counts(result.budgets, result.accept_lengths)
    return {
        "tau": result.tau,
        "rounds": result.num_rounds,
        "ttft_s": result.ttft_s,
        "latency_s": result.latency_s,
        "budgets": sorted(set(result.budgets)),
        # vLLM's spec-decode counts of this request: what /metrics adds up over requests
        "num_drafts": counts.num_drafts,
        "num_draft_tokens": counts.num_draft_tokens,
        "num_accepted_tokens": counts.num_accepted_tokens,
        "engine_finish_reason": result.finish_reason,
    }
