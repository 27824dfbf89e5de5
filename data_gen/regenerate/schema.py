"""The regenerated-data schema: what `<out>/dataset` (and every shard) holds, row by row.

One row per sample:

| column          | type            | meaning                                                                  |
|-----------------|-----------------|--------------------------------------------------------------------------|
| `id`            | string          | the sample id (the source's id field, else the row index); unique         |
| `domain`        | string          | the source's domain field (toy: math / code / prose); may be empty        |
| `input_ids`     | list<int32>     | chat-formatted prompt ids, then the response ids; ends with the stop      |
|                 |                 | token when `finish_reason == "eos"`                                       |
| `loss_mask`     | list<int8>      | 1 exactly on the response ids (each stop token included), else 0         |
| `prompt_len`    | int32           | number of (first-turn) prompt ids: `loss_mask[:prompt_len]` is all 0      |
| `response`      | string          | the response text (special tokens dropped; a conversation's answers       |
|                 |                 | joined by a blank line)                                                   |
| `finish_reason` | string          | `"eos"` (a stop token was produced) or `"length"` (`max_new_tokens` hit); |
|                 |                 | a conversation's: its last answer's                                       |

A single-turn row is `prompt + response`, `loss_mask == [0]*prompt_len + [1]*(len-prompt_len)`. A
multi-turn row (`max_turns` > 1) is the whole conversation: the first prompt, then each answer exactly as
generated followed by the template text of the next user turn; `loss_mask` is 1 on every answer and 0 on
the turns between them.

The distillation stage reads `input_ids` / `loss_mask` (docs/DESIGN.md section 3). The output folder:

    <out>/run.json          run fingerprint (target path, config hash, settings); a different run is refused
    <out>/shards/*.parquet  finished rows, one file per flush, written to a temp name then renamed
    <out>/manifest/*.jsonl  per rank: one line per shard {"shard", "ids"}; reconciled with the shards on start
    <out>/dataset/          the merged dataset (`datasets.load_from_disk`), each id exactly once, sorted by id
    <out>/summary.json      counts of the last run (written, skipped, truncated, failed, tokens/s)
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

FINISH_REASONS = ("eos", "length")

ARROW_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field("response", pa.string(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
    ]
)

COLUMNS = tuple(ARROW_SCHEMA.names)


def make_row(
    sample_id: str,
    domain: str,
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    response: str,
    finish_reason: str,
    loss_mask: Sequence[int] | None = None,
) -> dict:
    """One schema row from a prompt and its regenerated response (`loss_mask` over prompt + response for
    a conversation; None: 1 on the whole response)."""
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
    p, r = [int(t) for t in prompt_ids], [int(t) for t in response_ids]
    mask = [0] * len(p) + [1] * len(r) if loss_mask is None else [int(m) for m in loss_mask]
    if len(mask) != len(p) + len(r):
        raise ValueError(f"row {sample_id!r}: loss_mask has {len(mask)} entries for {len(p) + len(r)} ids")
    return {
        "id": str(sample_id),
        "domain": str(domain or ""),
        "input_ids": p + r,
        "loss_mask": mask,
        "prompt_len": len(p),
        "response": response,
        "finish_reason": finish_reason,
    }


def rows_to_table(rows: Sequence[dict]) -> pa.Table:
    """An Arrow table with exactly :data:`ARROW_SCHEMA` (shards and the merged dataset use it)."""
    return pa.Table.from_pylist(list(rows), schema=ARROW_SCHEMA)


def check_row(row: dict) -> None:
    """Raise ValueError when a row breaks the schema's invariants (used by tests and the merge)."""
    n, p = len(row["input_ids"]), int(row["prompt_len"])
    if len(row["loss_mask"]) != n:
        raise ValueError(f"row {row['id']!r}: loss_mask and input_ids differ in length")
    mask = [int(m) for m in row["loss_mask"]]
    if any(mask[:p]) or any(m not in (0, 1) for m in mask) or (n > p and mask[p] != 1):
        raise ValueError(
            f"row {row['id']!r}: loss_mask is not 0 on the prompt and 1 from the first response token"
        )
    if row["finish_reason"] not in FINISH_REASONS:
        raise ValueError(f"row {row['id']!r}: bad finish_reason {row['finish_reason']!r}")
