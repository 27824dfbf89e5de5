"""`CompletionClient`: one OpenAI-compatible `/v1/completions` endpoint, token ids in and out, with retries.

Regeneration through a serving engine (vLLM, SGLang, trtllm-serve, jetflow-serve) sends each chat-formatted
prompt as token ids and asks for the response as token ids (`return_token_ids`, vLLM's extension): text
round-trips are not exact (a re-tokenized response need not be the ids the model produced).

The retry loop is ours, not the `openai` package's (its retries are off), because a run of hours must
survive a restarting server and a full queue but fail with one clear line when the endpoint is really
gone: connection errors, timeouts, 408, 429 and 5xx are retried with exponential backoff and jitter (at
least the server's `Retry-After`); other 4xx are not retried (they will not change). `close()` stops the
retries of every thread at once, so a failing run does not linger in its backoff sleeps.
"""

from __future__ import annotations

import email.utils
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from jetflow_pl.errors import UserInputError

__all__ = [
    "Completion",
    "CompletionClient",
    "EndpointError",
    "EndpointUnavailable",
    "RequestFailed",
    "RetryPolicy",
    "parse_retry_after",
]

T = TypeVar("T")

#: resume advice appended to a fatal endpoint error (the writer keeps every finished shard)
RESUME_HINT = "the shards written so far are intact; fix the endpoint and rerun the same command to resume"


class EndpointError(UserInputError):
    """The endpoint cannot serve this run (unreachable, another model, bad credentials, no token ids)."""


class EndpointUnavailable(EndpointError):
    """Still unreachable (or overloaded, or failing with 5xx) after every retry."""


class RequestFailed(EndpointError):
    """One request failed for a reason of its own (a 4xx, or an answer that cannot be an exact row); the
    regeneration's `on_error` decides whether that stops the run or only that sample."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep trying: `max_retries` retries after the first attempt, the k-th (0-based) after
    a delay drawn uniformly from [d/2, d] with d = min(max_backoff_s, backoff_s * 2**k) ("equal jitter":
    clients that failed together do not retry together), and never sooner than the server's
    `Retry-After` (honoured up to `max_backoff_s`)."""

    max_retries: int = 8
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"retry settings must be >= 0, got {self}")

    def delay(self, retry: int, retry_after: float | None, rng: random.Random) -> float:
        step = min(self.max_backoff_s, self.backoff_s * 2.0**retry)
        wait = rng.uniform(step / 2, step)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.max_backoff_s))
        return wait


def parse_retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds the server asks to wait: `retry-after-ms` (OpenAI's), else `Retry-After` as seconds or as
    an HTTP date; None when absent or unreadable."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _retryable_status(status: int) -> bool:
    return status in (408, 429) or status >= 500


def _describe(err: BaseException) -> str:
    """A short reason: the HTTP status and the server's message, or the connection error."""
    import openai

    if isinstance(err, openai.APIStatusError):
        body = err.body
        msg = None
        if isinstance(body, dict):
            inner = body.get("error") if isinstance(body.get("error"), dict) else body
            msg = inner.get("message")
        return f"HTTP {err.status_code}: {msg or err.message}"
    cause = err.__cause__
    detail = f"{type(cause).__name__}: {cause}" if cause is not None else str(err)
    return f"{type(err).__name__} ({detail})"


@dataclass(frozen=True)
class Completion:
    """One `/v1/completions` answer: `token_ids` / `prompt_token_ids` only where the endpoint returns them."""

    text: str
    finish_reason: str | None
    token_ids: list[int] | None
    prompt_token_ids: list[int] | None


class CompletionClient:
    """The official `openai` client for one endpoint, with our retries (see the module docstring).

    Args:
        base_url: the API root, as the `openai` client takes it (usually ends with `/v1`).
        api_key: sent as the bearer token (local servers ignore it).
        timeout_s: per request, connect to last byte.
        retry: the retry policy.
        sleep: `sleep(seconds)` between retries; default: a wait that `close()` interrupts.
        rng: the jitter's random source (tests pass a seeded one).

    Thread-safe: one client serves every worker thread (the `openai` client is; the counters are locked).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], Any] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        try:
            import openai
        except ImportError as err:
            raise UserInputError(
                "regenerating through an endpoint needs the official openai client: "
                "pip install 'jetflow-pl[endpoint]' (or pip install openai)"
            ) from err

        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self._closed = threading.Event()
        self._sleep = sleep or self._closed.wait
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self.requests = 0  # HTTP attempts, retries included
        self.retries = 0
        self._client = openai.OpenAI(
            base_url=self.base_url, api_key=api_key or "EMPTY", max_retries=0, timeout=timeout_s
        )

    def close(self) -> None:
        """Stop: pending retries give up at once, new calls fail."""
        self._closed.set()

    # ------------------------------------------------------------------ the retry loop
    def _count(self, retry: bool) -> None:
        with self._lock:
            self.requests += 1
            self.retries += int(retry)

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()` with retries; `what` names the call in the error ("POST /completions")."""
        import openai

        start = time.monotonic()
        last: BaseException | None = None
        for attempt in range(self.retry.max_retries + 1):
            if self._closed.is_set():
                raise EndpointUnavailable(f"endpoint {self.base_url}: {what} abandoned (the run is stopping)")
            self._count(retry=attempt > 0)
            try:
                return fn()
            except openai.APIConnectionError as err:  # refused, reset, DNS, timeouts (APITimeoutError)
                last, retry_after = err, None
            except openai.APIStatusError as err:
                if not _retryable_status(err.status_code):
                    raise self._refusal(what, err) from err
                last, retry_after = err, parse_retry_after(err.response.headers)
            if attempt < self.retry.max_retries:
                self._sleep(self.retry.delay(attempt, retry_after, self._rng))
        assert last is not None
        raise EndpointUnavailable(
            f"endpoint {self.base_url} unusable: {what} failed {self.retry.max_retries + 1} times over "
            f"{time.monotonic() - start:.1f} s, last: {_describe(last)}; {RESUME_HINT}"
        ) from last

    def _refusal(self, what: str, err: Any) -> EndpointError:
        status, reason = err.status_code, _describe(err)
        if status == 404:
            return EndpointError(
                f"endpoint {self.base_url}: {what} answered {reason}; the model is not served there "
                f"(GET {self.base_url}/models lists what is) or base_url is not the API root (it usually "
                "ends with /v1)"
            )
        if status in (401, 403):
            return EndpointError(
                f"endpoint {self.base_url} refused the credentials ({reason}); set api_key_env to the "
                "environment variable holding the key"
            )
        return RequestFailed(f"endpoint {self.base_url} refused {what} ({reason})")

    # ------------------------------------------------------------------ the calls
    def models(self) -> list[dict]:
        """`GET /models`: the served models as dicts (`id`, and `max_model_len` on vLLM / jetflow-serve)."""
        page = self.call("GET /models", self._client.models.list)
        return [m.model_dump() for m in page.data]

    def resolve_model(self, model: str | None) -> dict:
        """The served model entry named `model` (None: the endpoint's only model); a clear error otherwise."""
        served = self.models()
        names = [m["id"] for m in served]
        if model is None:
            if len(served) != 1:
                raise EndpointError(
                    f"endpoint {self.base_url} serves {len(served)} models {names}: set model to one of them"
                )
            return served[0]
        for m in served:
            if m["id"] == model:
                return m
        raise EndpointError(
            f"endpoint {self.base_url} serves {names}, not {model!r}: point base_url at a server of "
            f"{model!r} or set model to the name it serves"
        )

    def complete(
        self,
        model: str,
        prompt_ids: Sequence[int],
        max_tokens: int,
        params: Mapping[str, Any],
        extra_body: Mapping[str, Any],
    ) -> Completion:
        """One non-streamed completion of a token-id prompt (`params`: OpenAI fields; `extra_body`: vendor
        fields such as `return_token_ids`, `top_k`, `stop_token_ids`)."""

        def create():
            return self._client.completions.create(
                model=model,
                prompt=[int(t) for t in prompt_ids],
                max_tokens=int(max_tokens),
                extra_body=dict(extra_body),
                **params,
            )

        out = self.call("POST /completions", create)
        if not out.choices:
            raise RequestFailed(f"endpoint {self.base_url} answered a completion without choices")
        choice = out.choices[0]
        extra = choice.model_extra or {}
        ids, prompt = extra.get("token_ids"), extra.get("prompt_token_ids")
        return Completion(
            text=choice.text or "",
            finish_reason=choice.finish_reason,
            token_ids=[int(t) for t in ids] if ids is not None else None,
            prompt_token_ids=[int(t) for t in prompt] if prompt is not None else None,
        )
