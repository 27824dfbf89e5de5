"""Random token documents in the regeneration schema (`data_gen/regenerate/schema.py`): what the
distillation tests train on when the content does not matter, only the shapes and masks."""

from __future__ import annotations

import random
from collections.abc import Sequence


def random_rows(
    n: int,
    vocab: int,
    seed: int = 0,
    prompt_len: tuple[int, int] = (3, 10),
    response_len: tuple[int, int] = (8, 30),
    domains: Sequence[str] = ("code", "math"),
) -> list[dict]:
    """`n` rows: prompt and response lengths drawn from the inclusive ranges, ids from 3..vocab-1 (0-2 are
    the toy's pad/eos/mask), loss on the response; row i's domain is `domains[i % len(domains)]`."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        p, r = rng.randint(*prompt_len), rng.randint(*response_len)
        rows.append(
            {
                "id": f"{i:05d}",
                "domain": domains[i % len(domains)],
                "input_ids": [rng.randint(3, vocab - 1) for _ in range(p + r)],
                "loss_mask": [0] * p + [1] * r,
                "prompt_len": p,
                "response": "",
                "finish_reason": "eos",
            }
        )
    return rows
