"""Choosing the draft head's MASK token for a real tokenizer, and proving it never occurs in the data.

Why: the head's block is `[anchor, MASK, ..., MASK]`, so MASK must be an id the target never sees as a real
token: neither pad nor EOS (docs/DESIGN.md section 2), not part of the chat format, and absent from the training
data (a MASK id that occurs in the data makes "predict here" and "this token" the same input). Toy
tokenizers reserve `<|mask|>`; a real vocabulary often has no free id (SmolLM2 fills all 49152), so the
MASK must be one of the tokenizer's reserved special tokens (e.g. SmolLM2's `<filename>`, Llama 3's
`<|reserved_special_token_N|>`), or, where the embedding matrix is larger than the tokenizer (Qwen), the
first embedding row no token maps to.

A special token is matched only by its literal text, so it never comes out of normal text; whether a
dataset contains that literal is a fact about the data, which `check_token_absent` proves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from jetflow_pl.errors import UserInputError

#: A probe conversation: every role the chat templates know, so every id the format itself adds shows up.
_PROBE_CONVERSATIONS: tuple[tuple[dict[str, str], ...], ...] = (
    (
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "And 4 + 4?"},
    ),
    ({"role": "user", "content": "Hello."},),
)

#: Name fragments of tokens that tokenizers reserve for exactly this kind of use, most preferred first.
_RESERVED_HINTS = ("mask", "reserved", "unused")


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple, set)):
        return {int(v) for v in value if v is not None}
    return {int(value)}


def chat_template_ids(tokenizer) -> set[int]:
    """Every token id the tokenizer's chat template itself emits (empty when it has none).

    Renders the probe conversations with and without the generation prompt and tokenizes them the way
    regeneration does (`add_special_tokens=False` on the rendered text, plus the BOS/EOS a plain call adds).
    """
    if not getattr(tokenizer, "chat_template", None):
        return set()
    found: set[int] = set()
    for conversation in _PROBE_CONVERSATIONS:
        for gen_prompt in (True, False):
            try:
                text = tokenizer.apply_chat_template(
                    list(conversation), tokenize=False, add_generation_prompt=gen_prompt
                )
            except Exception:  # noqa: BLE001 - templates raise anything (e.g. no system role); try the next
                continue
            found.update(int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"])
    return found


def reserved_special_ids(tokenizer, exclude: Iterable[int] = ()) -> list[int]:
    """Special-token ids usable as MASK: special added tokens that are not pad/EOS/BOS/UNK, not emitted by
    the chat template and not in `exclude` (e.g. the model config's extra EOS ids). Sorted ascending."""
    taken = _ids(list(exclude))
    for name in ("pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id"):
        taken |= _ids(getattr(tokenizer, name, None))
    taken |= chat_template_ids(tokenizer)
    special: set[int] = set()
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for tid, tok in decoder.items():
        if getattr(tok, "special", False):
            special.add(int(tid))
    special |= _ids(list(getattr(tokenizer, "all_special_ids", []) or []))
    return sorted(special - taken)


def propose_mask_token_id(tokenizer, vocab_size: int | None = None, exclude: Iterable[int] = ()) -> int:
    """A MASK id for `tokenizer` that the target never sees as a real token.

    Order of preference:
    1. `vocab_size` (the target's embedding rows) larger than the tokenizer: the first id no token maps to
       (`len(tokenizer)`; what DFlash uses for Qwen3). It cannot occur in any tokenized text.
    2. A reserved special token (`reserved_special_ids`) whose name says it is reserved for this: containing
       "mask", then "reserved", then "unused" (lowest id within a kind).
    3. Otherwise the highest reserved special id (e.g. SmolLM2's `<empty_output>`, 16): the last-added
       special tokens are the rarest in chat data.
    Raises `UserInputError` when no id qualifies.
    """
    n = len(tokenizer)
    if vocab_size is not None and int(vocab_size) > n:
        return n
    candidates = reserved_special_ids(tokenizer, exclude)
    if not candidates:
        raise UserInputError(
            "no reserved token id for the MASK token: the vocabulary has no free id and every special token "
            "is pad/EOS/BOS/UNK or part of the chat format; pass mask_token_id explicitly"
        )
    names = {tid: str(tokenizer.convert_ids_to_tokens(tid)).lower() for tid in candidates}
    for hint in _RESERVED_HINTS:
        hinted = [tid for tid in candidates if hint in names[tid]]
        if hinted:
            return hinted[0]
    return candidates[-1]


def _token_str(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return "?"
    try:
        return str(tokenizer.convert_ids_to_tokens(int(token_id)))
    except (IndexError, KeyError, TypeError, ValueError):
        return "?"


def _first_hit_arrow(dataset, column: str, token_id: int, batch_size: int = 4096) -> tuple[int, int] | None:
    """(row, position) of the first occurrence in a `datasets.Dataset` column, scanning Arrow batches.

    Iterates the dataset's own view (`with_format("arrow").iter`), so a `select`/`shuffle`/`filter`ed
    dataset reports rows by their index in that view.
    """
    import pyarrow.compute as pc

    base = 0
    for batch in dataset.select_columns([column]).with_format("arrow").iter(batch_size=batch_size):
        for chunk in batch.column(column).chunks:
            flat = pc.list_flatten(chunk)
            hits = pc.indices_nonzero(pc.equal(flat, token_id))
            if len(hits):
                first = hits[0].as_py()
                row = pc.list_parent_indices(chunk)[first].as_py()
                start = chunk.offsets[row].as_py() - chunk.offsets[0].as_py()
                return base + row, first - start
            base += len(chunk)
    return None


def _first_hit_rows(rows: Iterable[Any], column: str, token_id: int) -> tuple[int, int] | None:
    for i, row in enumerate(rows):
        ids = row[column] if isinstance(row, dict) else row
        for j, tid in enumerate(ids):
            if int(tid) == token_id:
                return i, j
    return None


def check_token_absent(
    dataset: Any,
    token_id: int,
    tokenizer=None,
    column: str = "input_ids",
    what: str = "mask_token_id",
) -> None:
    """Prove `token_id` occurs nowhere in `dataset[column]`; else one `UserInputError` naming the id, its
    token string and the first row (and position) that contains it.

    `dataset`: a `datasets.Dataset` (scanned chunk by chunk in Arrow, no Python row loop, bounded memory)
    or any sequence of rows (dicts with `column`, or plain id sequences).
    """
    token_id = int(token_id)
    if hasattr(dataset, "data") and hasattr(dataset, "column_names"):
        if column not in dataset.column_names:
            raise UserInputError(f"dataset has no column {column!r} (columns: {dataset.column_names})")
        hit = _first_hit_arrow(dataset, column, token_id)
        row_id = dataset[hit[0]]["id"] if hit is not None and "id" in dataset.column_names else None
    else:
        rows = dataset if isinstance(dataset, Sequence) else list(dataset)
        hit = _first_hit_rows(rows, column, token_id)
        row_id = None
    if hit is None:
        return
    row, pos = hit
    where = f"row {row}" + (f" (id {row_id!r})" if row_id is not None else "")
    raise UserInputError(
        f"{what} {token_id} ({_token_str(tokenizer, token_id)!r}) occurs in the data: {where} of column "
        f"{column!r} holds it at position {pos}; choose a reserved id that never occurs in the data "
        "(jetflow_pl.tokens.propose_mask_token_id) or drop such rows"
    )
