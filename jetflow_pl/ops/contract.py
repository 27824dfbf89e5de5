"""The input contract of the tree-attention op, checked the same way by every implementation of it.

`tree_attention.py` (the reference and the custom op) and `triton_tree_attention.py` (the Triton kernel)
both call `check_inputs` before they compute, so a bad shape or dtype is the same one-line `ValueError`
whichever runs. `WORD_BITS` is the packed mask's word size (`jetflow_pl.masks` packs with it).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["WORD_BITS", "check_inputs"]

#: bits per word of a packed mask row (int32 words)
WORD_BITS = 32


def _static(*sizes: object) -> bool:
    """True when every size is a plain int (eager, or a static axis while exporting)."""
    return all(isinstance(s, int) for s in sizes)


def check_inputs(
    query: Tensor,
    past_key: Tensor,
    past_value: Tensor,
    key: Tensor,
    value: Tensor,
    packed_mask: Tensor,
    past_lengths: Tensor | None,
) -> None:
    """Ranks, dtypes and the sizes that are known (symbolic sizes of an export are left to the graph)."""
    _check_shapes(query, past_key, past_value, key, value)
    if packed_mask.dtype != torch.int32:
        raise ValueError(f"packed_mask must be int32, got {packed_mask.dtype}")
    if packed_mask.dim() not in (2, 3):
        raise ValueError(f"packed_mask must be [N, W] or [B, N, W], got {tuple(packed_mask.shape)}")
    b, n = query.shape[0], query.shape[2]
    rows, words = packed_mask.shape[-2], packed_mask.shape[-1]
    if _static(rows, n) and rows != n:
        raise ValueError(f"packed_mask has {rows} rows, expected N = {n} (one per query row)")
    if _static(words, n) and words * WORD_BITS < n:
        raise ValueError(f"packed_mask has {words} words per row, N = {n} needs {-(-n // WORD_BITS)}")
    if packed_mask.dim() == 3 and _static(packed_mask.shape[0], b) and packed_mask.shape[0] != b:
        raise ValueError(f"packed_mask is [B={packed_mask.shape[0]}, N, W] but the batch is {b}")
    if past_lengths is not None:
        if past_lengths.dtype != torch.int32:
            raise ValueError(f"past_lengths must be int32, got {past_lengths.dtype}")
        if past_lengths.dim() != 1 or (_static(past_lengths.shape[0], b) and past_lengths.shape[0] != b):
            raise ValueError(f"past_lengths must be [B={b}], got {tuple(past_lengths.shape)}")


def _check_shapes(query: Tensor, past_key: Tensor, past_value: Tensor, key: Tensor, value: Tensor) -> None:
    if query.dim() != 4 or key.dim() != 4 or past_key.dim() != 4:
        raise ValueError("query, key and past_key must be 4-D [B, heads, rows, head_dim]")
    if key.shape != value.shape or past_key.shape != past_value.shape:
        raise ValueError(
            f"key/value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}, "
            f"past {tuple(past_key.shape)} vs {tuple(past_value.shape)}"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} must be a multiple of KV heads {key.shape[1]} (GQA)")
