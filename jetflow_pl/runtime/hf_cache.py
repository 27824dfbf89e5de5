"""The only module that reaches into Hugging Face KV-cache internals.

Speculative decoding appends a whole tree to the target cache for the verify forward, then keeps only the
root and the accepted nodes. HF's `Cache` API changes between releases; keeping every access here means a
transformers upgrade touches one file.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache


def new_cache() -> DynamicCache:
    """An empty growable cache for any supported model, with every row of every layer kept.

    Why not `DynamicCache(config=config)`: for a model with sliding-window layers (Gemma 3, Mistral,
    Qwen2/3 with `use_sliding_window`) transformers then drops the rows that left the window, so a layer's
    row `i` no longer holds position `i`, and tree staging and compaction (which index rows by position)
    would keep the wrong rows. Here the window is applied by the attention mask alone
    (`TargetModel.verify_mask`, transformers' own masks on a chain); the cost is the window layers' rows
    beyond the window, kept in memory.
    """
    return DynamicCache()


def cache_length(cache: Cache | None) -> int:
    """Number of positions held (0 for None or an empty cache)."""
    return 0 if cache is None else int(cache.get_seq_length())


def _layers(cache: Cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"unsupported cache type {type(cache).__name__}: expected a transformers DynamicCache"
        )
    return layers


def compact_cache(cache: Cache, past_len: int, keep: torch.Tensor) -> None:
    """Keep the prefix `[0, past_len)` plus the rows `past_len + keep` (in that order); drop the rest.

    `keep` holds indices into the rows appended after `past_len` (tree node ids of root + accepted nodes,
    ascending). Only the tail is rewritten: the prefix is never copied.
    """
    keep = keep.to(torch.long)
    n_keep = int(keep.numel())
    for layer in _layers(cache):
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        src = keep.to(layer.keys.device) + past_len
        tail_k = layer.keys.index_select(-2, src)
        tail_v = layer.values.index_select(-2, src)
        layer.keys = torch.cat([layer.keys[..., :past_len, :], tail_k], dim=-2)
        layer.values = torch.cat([layer.values[..., :past_len, :], tail_v], dim=-2)
    if cache_length(cache) != past_len + n_keep:
        raise RuntimeError("KV compaction produced an inconsistent cache length")


def crop_cache(cache: Cache, length: int) -> None:
    """Truncate the cache to its first `length` positions."""
    for layer in _layers(cache):
        if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def layer_tensors(cache: Cache) -> list[torch.Tensor]:
    """`[k_0, v_0, k_1, v_1, ...]` of the initialized layers (each `[B, Hkv, S, d]`), in layer order."""
    out: list[torch.Tensor] = []
    for layer in _layers(cache):
        if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
            out += [layer.keys, layer.values]
    return out


def set_layer_tensors(cache: Cache, tensors: list[torch.Tensor]) -> None:
    """Put `tensors` (as `layer_tensors` returned them, re-laid out: other batch rows or lengths) back."""
    it = iter(tensors)
    for layer in _layers(cache):
        if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
            layer.keys, layer.values = next(it), next(it)
    if next(it, None) is not None:
        raise RuntimeError("more KV tensors than initialized cache layers")


def cache_from_layer_tensors(tensors: list[torch.Tensor]) -> DynamicCache:
    """A new cache holding `tensors` (`[k_0, v_0, k_1, v_1, ...]`, one pair per layer), every row kept
    (`new_cache`)."""
    pairs = list(zip(tensors[0::2], tensors[1::2], strict=True))
    return DynamicCache(ddp_cache_data=pairs)


def select_batch(cache: Cache, rows: torch.Tensor) -> None:
    """Keep only batch rows `rows` (e.g. drop finished sequences from a batched generation)."""
    rows = rows.to(torch.long)
    for layer in _layers(cache):
        if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
            layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
            layer.values = layer.values.index_select(0, rows.to(layer.values.device))
