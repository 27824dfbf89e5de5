"""Regeneration through an OpenAI-compatible endpoint: the same rows, shards and resume, another engine.

`EndpointRegenerationModule` is a drop-in for `RegenerationModule` in a predict config: the same
`PromptDataModule` (prompts chat-formatted with a local copy of the served model's tokenizer), the same
records out of `predict_step`, so the same `RegenerationWriter` (atomic shards, manifests, fingerprint,
resume, exactly-once merge). Only the tokens come from elsewhere: each sample is one `/v1/completions`
request to a running engine (vLLM, SGLang, trtllm-serve, jetflow-serve), `concurrency` of them in flight
at a time, with the retries of `endpoint_client.CompletionClient`.

Exactness: the prompt goes out as token ids and the response comes back as token ids
(`response_ids: token_ids`, the `return_token_ids` extension of vLLM and jetflow-serve), so a greedy row
is the engine's greedy tokens, as in process. A row ends where the in-process one would: at the first id
of this run's stop set (the tokenizer's EOS, the generation config's EOS ids, `stop_token_ids`; they are
also sent as `stop_token_ids`, and a server that ignores them is cut client-side), else after exactly
`max_new_tokens`. An answer that cannot be such a row (the server stopped on a token outside the stop
set, capped the length, ran on other prompt ids) is refused, not written. `response_ids: text` is the
fallback for endpoints that return only text: the text is re-tokenized, which is NOT exact (the summary
says so).

`EndpointRegenerationWriter` is `RegenerationWriter` plus the endpoint in `run.json` and `summary.json`.
The base URL is recorded there but is not part of the config hash (replicas behind other URLs give the
same rows, and a rerun against a restarted server on another port resumes); the served model name, the
tokenizer's files and the generation settings are.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import lightning as L

from data_gen.regenerate.conversation import answer_turns, transcript_records
from data_gen.regenerate.endpoint_client import (
    Completion,
    CompletionClient,
    EndpointError,
    RequestFailed,
    RetryPolicy,
)
from data_gen.regenerate.module import collect_stop_ids, sample_seed
from data_gen.regenerate.writer import RegenerationWriter
from jetflow_pl.errors import UserInputError
from jetflow_pl.files import atomic_write_bytes

__all__ = ["EndpointRegenerationModule", "EndpointRegenerationWriter", "response_tokens"]

ResponseIds = Literal["token_ids", "text"]

#: files that decide how a tokenizer formats and splits text (hashed into the run fingerprint)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)


def tokenizer_digest(path: str | Path) -> str:
    """A content hash of the tokenizer's files (the prompt ids depend on them, not on where they lie)."""
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        f = Path(path) / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def response_tokens(
    completion: Completion,
    prompt_ids: Sequence[int],
    stop_ids: Sequence[int],
    max_new_tokens: int,
    mode: ResponseIds,
    tokenizer: Any,
) -> tuple[list[int], str]:
    """The row's response ids (stop token included) and finish reason ("eos" / "length"), exactly as
    `batched_generate` would end them; raises `RequestFailed` for an answer that cannot be that row."""
    stop = set(int(t) for t in stop_ids)
    if mode == "token_ids":
        if completion.token_ids is None:
            raise EndpointError(
                "the endpoint returned no token ids (it ignores `return_token_ids`; vLLM >= 0.10.2 and "
                "jetflow-serve support it): use a server that does, or set response_ids: text to "
                "re-tokenize the text (not exact)"
            )
        if completion.prompt_token_ids is not None and completion.prompt_token_ids != list(prompt_ids):
            raise RequestFailed(
                f"the endpoint ran on other prompt ids than sent ({len(completion.prompt_token_ids)} vs "
                f"{len(prompt_ids)} tokens): it truncates or re-tokenizes prompts"
            )
        tokens = list(completion.token_ids)
    else:
        tokens = list(tokenizer.encode(completion.text, add_special_tokens=False))
        if completion.finish_reason == "stop":  # the text drops the stop token: put the EOS back
            eos = tokenizer.eos_token_id
            tokens.append(int(eos) if eos is not None and int(eos) in stop else min(stop))
    for i, t in enumerate(tokens):
        if t in stop:  # the first stop id ends the row, whether or not the server stopped there
            return tokens[: i + 1], "eos"
    if mode == "text":
        return tokens, "length"
    if len(tokens) > max_new_tokens:
        raise RequestFailed(
            f"the endpoint returned {len(tokens)} tokens, more than max_tokens {max_new_tokens}"
        )
    if completion.finish_reason == "length" and len(tokens) == max_new_tokens:
        return tokens, "length"
    if completion.finish_reason == "length":
        raise RequestFailed(
            f"the endpoint ended the response at {len(tokens)} < {max_new_tokens} tokens (finish_reason "
            "length): it capped max_tokens (its context window or max-tokens limit)"
        )
    if completion.finish_reason == "stop":
        last = tokens[-1] if tokens else None
        raise RequestFailed(
            f"the endpoint stopped (finish_reason stop) after token {last}, which is not a stop id of this "
            f"run {sorted(stop)}: add the model's other EOS ids to stop_token_ids (or the server applied a "
            "stop string)"
        )
    raise RequestFailed(f"the endpoint answered finish_reason {completion.finish_reason!r}")


class EndpointRegenerationModule(L.LightningModule):
    """`RegenerationModule`'s rows from an OpenAI-compatible `/v1/completions` endpoint (module docstring).

    Args:
        base_url: the API root (e.g. `http://127.0.0.1:8000/v1`); not part of the config hash.
        tokenizer_path: a local folder with the served model's tokenizer (chat template included).
        model: the served model name (None: the endpoint's only model); checked against `GET /models`.
        max_new_tokens / temperature / top_k / top_p / seed / stop_token_ids / on_error: as for
            `RegenerationModule` (a sampled request carries the per-sample seed `sample_seed(seed, id)`:
            reproducible on the same engine, not the in-process draws).
        context_length: the model's context (None: the endpoint's `max_model_len`).
        concurrency: requests in flight at once (keep the data `batch_size` a few times larger: a batch
            waits for its slowest request).
        request_timeout_s: per request, connect to last byte.
        max_retries / backoff_s / max_backoff_s: `RetryPolicy` (connection errors, timeouts, 408, 429,
            5xx; `Retry-After` honoured up to `max_backoff_s`).
        response_ids: "token_ids" (exact) or "text" (re-tokenized: for text-only endpoints, NOT exact).
        extra_body: more vendor fields for every request (hashed: they may change the output).
        api_key_env: the environment variable holding the API key (the key never enters a config).
    """

    def __init__(
        self,
        base_url: str,
        tokenizer_path: str,
        model: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: list[int] | None = None,
        context_length: int | None = None,
        concurrency: int = 16,
        request_timeout_s: float = 600.0,
        max_retries: int = 8,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        response_ids: ResponseIds = "token_ids",
        extra_body: dict[str, Any] | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        on_error: Literal["raise", "skip"] = "raise",
    ) -> None:
        super().__init__()
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if response_ids not in ("token_ids", "text"):
            raise ValueError(f"response_ids must be 'token_ids' or 'text', got {response_ids!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.save_hyperparameters()
        from transformers import AutoTokenizer, GenerationConfig

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        except Exception as err:
            raise UserInputError(
                f"cannot load a tokenizer from {tokenizer_path}: {type(err).__name__}: {err}"
            ) from err
        gen_eos = None
        if (Path(tokenizer_path) / "generation_config.json").is_file():
            gen_eos = GenerationConfig.from_pretrained(tokenizer_path).eos_token_id
        self.stop_ids = collect_stop_ids(self.tokenizer, gen_eos, stop_token_ids)
        if not self.stop_ids:
            raise UserInputError("no stop token: the tokenizer has no EOS and no stop_token_ids were given")
        self.max_new_tokens = int(max_new_tokens)
        self.client = CompletionClient(
            base_url,
            api_key=os.environ.get(api_key_env),
            timeout_s=request_timeout_s,
            retry=RetryPolicy(max_retries, backoff_s, max_backoff_s),
        )
        served = self.client.resolve_model(model)  # fails fast, before a byte is written
        self.model_name = str(served["id"])
        ctx = context_length if context_length is not None else served.get("max_model_len")
        if ctx is None:
            raise UserInputError(
                f"endpoint {self.client.base_url} does not report max_model_len for {self.model_name!r}: "
                "set context_length"
            )
        self.context_length = int(ctx)
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ run identity
    def fingerprint(self) -> dict:
        """What decides the rows: the served model, the tokenizer's files, the generation settings. Not
        the base URL, the concurrency or the retry settings."""
        hp = self.hparams
        fp = {
            "backend": "openai-completions",
            "target_path": f"endpoint:{self.model_name}",
            "model": self.model_name,
            "tokenizer": tokenizer_digest(hp.tokenizer_path),
            "context_length": self.context_length,
            "max_new_tokens": self.max_new_tokens,
            "temperature": hp.temperature,
            "top_k": hp.top_k,
            "top_p": hp.top_p,
            "stop_ids": self.stop_ids,
            "response_ids": hp.response_ids,
            "extra_body": hp.extra_body or {},
        }
        if hp.temperature > 0:
            fp["seed"] = hp.seed
        return fp

    def endpoint_info(self) -> dict:
        """Where the rows came from (recorded beside the fingerprint, outside its hash)."""
        return {
            "base_url": self.client.base_url,
            "model": self.model_name,
            "exact": self.hparams.response_ids == "token_ids",
            "requests": self.client.requests,
            "retries": self.client.retries,
        }

    # ------------------------------------------------------------------ generation
    def _request(self, sample_id: str, prompt_ids: list[int]) -> Completion:
        """One sample's request (on a worker thread: only the HTTP call, no tokenizer use)."""
        hp = self.hparams
        params: dict[str, Any] = {"temperature": hp.temperature, "top_p": hp.top_p}
        if hp.temperature > 0:
            params["seed"] = sample_seed(hp.seed, sample_id)
        extra: dict[str, Any] = {"stop_token_ids": self.stop_ids}
        if hp.top_k:
            extra["top_k"] = hp.top_k
        if hp.response_ids == "token_ids":
            extra["return_token_ids"] = True
        extra.update(hp.extra_body or {})
        return self.client.complete(self.model_name, prompt_ids, self.max_new_tokens, params, extra)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.hparams.concurrency, thread_name_prefix="regen-endpoint")
        return self._pool

    def _abort(self, futures: Sequence[Future]) -> None:
        """Stop every request of the batch (pending ones never start, retrying ones give up)."""
        for f in futures:
            f.cancel()
        self.client.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _turn(self, batch: dict, rows: list[int], prompts: list[list[int]]) -> list:
        """One turn of the conversations at `rows`: their requests in flight together; per row the
        `(response ids, finish reason)` or, with `on_error: skip`, the `RequestFailed` it ended with."""
        pool = self._executor()
        futures = [pool.submit(self._request, batch["ids"][r], p) for r, p in zip(rows, prompts, strict=True)]
        results: list = []
        for fut, prompt in zip(futures, prompts, strict=True):
            try:  # the answers are read here, on one thread (a tokenizer is not safe to share)
                results.append(
                    response_tokens(
                        fut.result(),
                        prompt,
                        self.stop_ids,
                        self.max_new_tokens,
                        self.hparams.response_ids,
                        self.tokenizer,
                    )
                )
            except RequestFailed as err:
                if self.hparams.on_error == "raise":
                    self._abort(futures)
                    raise
                results.append(err)
            except BaseException:
                self._abort(futures)
                raise
        return results

    def predict_step(self, batch: dict, batch_idx: int = 0, dataloader_idx: int = 0) -> dict:
        """`{"records": [...], "failed": [{"id", "error"}], "new_tokens": int, "seconds": float}`, as
        `RegenerationModule.predict_step` (every turn of a conversation answered, `conversation.py`)."""
        t0 = time.perf_counter()
        done, failed_rows = answer_turns(
            batch,
            range(len(batch["ids"])),
            lambda rows, prompts: self._turn(batch, rows, prompts),
            self.tokenizer,
            self.stop_ids,
            self.max_new_tokens,
        )
        records = transcript_records(self.tokenizer, batch, done)
        failed = [{"id": batch["ids"][r], "error": str(err)} for r, err in sorted(failed_rows.items())]
        return {
            "records": records,
            "failed": failed,
            "new_tokens": sum(sum(r["loss_mask"]) for r in records),
            "seconds": time.perf_counter() - t0,
        }

    def on_predict_end(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def configure_optimizers(self):  # predict-only module
        return None


class EndpointRegenerationWriter(RegenerationWriter):
    """`RegenerationWriter` that also records the endpoint (base URL, served model, exact or re-tokenized,
    requests and retries) in `run.json` and `summary.json`, outside the config hash."""

    def run_fingerprint(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        fp = super().run_fingerprint(trainer, pl_module)
        info = getattr(pl_module, "endpoint_info", None)
        if info is not None:
            fp["endpoint"] = {k: v for k, v in info().items() if k not in ("requests", "retries")}
        return fp

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.summary = None
        super().teardown(trainer, pl_module, stage)
        info = getattr(pl_module, "endpoint_info", None)
        if self.summary is None or info is None:
            return
        ep = info()
        self.summary["endpoint"] = ep
        atomic_write_bytes(self.out / "summary.json", (json.dumps(self.summary, indent=2) + "\n").encode())
        exact = "exact token ids" if ep["exact"] else "re-tokenized text: NOT exact"
        print(
            f"regenerate: via {ep['base_url']} (model {ep['model']}, {exact}) | {ep['requests']} requests, "
            f"{ep['retries']} retries",
            flush=True,
        )
