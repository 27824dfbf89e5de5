"""The OpenAI wire format: request bodies (pydantic, validated by FastAPI), response and chunk bodies, and
the error JSON.

Only what the engine can honour is accepted: one choice (`n=1`), no logprobs/echo/penalties/tools; such
a request is refused with a 400 that names the field, as OpenAI does for a bad parameter, rather than
silently answered as if the parameter had been applied. Unknown extra fields are ignored (clients send
vendor fields freely). Extensions, as vLLM spells them: `top_k`, `ignore_eos`, `stop_token_ids` (ids that
end the request besides EOS, kept in the output as EOS is), `return_token_ids` (the generated ids as
`token_ids` on each choice; a non-streamed completion also carries `prompt_token_ids`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ServeError",
    "error_body",
]


class ServeError(Exception):
    """A request the server answers with an OpenAI error body and `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Sampling(BaseModel):
    """The parameters both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=64)
    return_token_ids: bool = False

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first parameter this server cannot honour, or None."""
        if self.n != 1:
            return "n", "only n=1 is supported"
        if self.presence_penalty or self.frequency_penalty:
            field = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return field, "penalties are not supported (they would change the target's distribution)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not supported"
        if len(self.stop_strings()) > 16:
            return "stop", "at most 16 stop strings"
        return None


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: `prompt` is text (fed raw, no chat template) or token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text (content parts of type `text` joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ServeError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`: the chat is formatted with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=0)

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tool calls are not supported"
        return super().unsupported()

    def chat(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them (`developer` is OpenAI's newer name of `system`)."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


# ---------------------------------------------------------------------------------------------------
# responses
# ---------------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def openai_finish_reason(engine_reason: str | None, stopped_by_string: bool) -> str | None:
    """The engine's reason in OpenAI's words: EOS, a stop id or a stop string -> "stop"."""
    if stopped_by_string or engine_reason in ("eos", "stop"):
        return "stop"
    if engine_reason == "length":
        return "length"
    return engine_reason


def _choice(
    content: dict[str, Any],
    finish: str | None,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None = None,
) -> dict:
    """One choice: its content (`text`, `message` or `delta`), then the fields every choice carries."""
    choice: dict[str, Any] = {"index": 0, **content, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return choice


def _envelope(rid: str, model: str, obj: str, choices: list[dict], **rest: Any) -> dict:
    """The fields every response and stream chunk shares, then `rest` (usage, extensions)."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices, **rest}


def completion_body(
    rid: str,
    model: str,
    text: str,
    finish: str | None,
    use: dict,
    extra: dict,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None = None,
) -> dict:
    """A `/v1/completions` answer; with `return_token_ids` the choice carries the generated ids and the
    prompt ids the engine ran on (vLLM's `token_ids` / `prompt_token_ids`)."""
    choice = _choice({"text": text}, finish, token_ids, prompt_token_ids)
    return _envelope(rid, model, "text_completion", [choice], usage=use, **extra)


def chat_body(
    rid: str, model: str, text: str, finish: str | None, use: dict, extra: dict, token_ids: list[int] | None
) -> dict:
    choice = _choice({"message": {"role": "assistant", "content": text}}, finish, token_ids)
    return _envelope(rid, model, "chat.completion", [choice], usage=use, **extra)


def completion_chunk(
    rid: str, model: str, text: str, finish: str | None, token_ids: list[int] | None = None
) -> dict:
    return _envelope(rid, model, "text_completion", [_choice({"text": text}, finish, token_ids)])


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, Any],
    finish: str | None,
    token_ids: list[int] | None = None,
) -> dict:
    return _envelope(rid, model, "chat.completion.chunk", [_choice({"delta": delta}, finish, token_ids)])


def usage_chunk(rid: str, model: str, obj: str, use: dict) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return _envelope(rid, model, obj, [], usage=use)
