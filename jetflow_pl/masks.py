"""Attention masks in the TensorRT-LLM packed layout: one home for packing, unpacking, chain and block masks,
and the batch packer the runtime hands to `jetflow::tree_attention`.

Layout (docs/DESIGN.md section 4): int32 words, row `i`, word `w`, bit `b` (LSB first) set iff row `32w + b`
is visible from row `i`; a word with bit 31 set is a negative int32. A single mask is `[N, ceil(N/32)]`;
a batch of requests is `[B, N, ceil(N/32)]` with per-request generation lengths (rows in use) and position
offsets (node depths), as TensorRT-LLM's `spec_decoding_packed_mask`, `spec_decoding_generation_lengths`
and `spec_decoding_position_offsets`. The KV prefix is never in the mask: its per-request length is the
op's `past_lengths`.

Padding convention of a batch (what `pack_tree_batch` writes and `tree_attention` relies on): rows and
columns at or past a request's generation length are all-zero bits and offset 0, so a real node never
sees a padding node, and a padding row sees only its request's prefix (or nothing: output 0).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from jetflow_pl.ops.contract import WORD_BITS
from jetflow_pl.ops.tree_attention import packed_mask_to_dense


class MaskedTree(Protocol):
    """What packing needs of a tree (`jetflow_pl.tree.DraftTree` is one): its node count, each node's
    depth and its ancestor-or-self mask. Stated here so the mask layout needs nothing from the tree module."""

    @property
    def num_nodes(self) -> int: ...

    @property
    def depths(self) -> Tensor: ...

    def ancestor_mask(self) -> Tensor: ...


__all__ = [
    "TreeBatchMasks",
    "block_mask",
    "chain_mask",
    "mask_words",
    "pack_mask",
    "pack_mask_batch",
    "pack_tree_batch",
    "unpack_mask",
]


def mask_words(n: int) -> int:
    """Packed words per row for `n` columns: `ceil(n / 32)`."""
    return (operator.index(n) + WORD_BITS - 1) // WORD_BITS


def pack_mask(dense: Tensor) -> Tensor:
    """Pack a boolean mask ``[..., M]`` into int32 words ``[..., ceil(M / 32)]``.

    Bit ``b`` (LSB first) of word ``w`` is column ``32 * w + b``. A word with bit 31 set is a negative
    int32 (two's complement), e.g. only bit 31 set -> ``-2**31``; all 32 bits set -> ``-1``.
    """
    if dense.dtype != torch.bool:
        raise ValueError(f"pack_mask expects a bool tensor, got {dense.dtype}")
    if dense.dim() < 1:
        raise ValueError("pack_mask expects at least one dimension")
    m = dense.shape[-1]
    words = mask_words(m)
    pad = words * WORD_BITS - m
    if pad:
        dense = torch.nn.functional.pad(dense, (0, pad), value=False)
    bits = dense.reshape(*dense.shape[:-1], words, WORD_BITS).to(torch.int64)
    weights = torch.bitwise_left_shift(
        torch.ones(WORD_BITS, dtype=torch.int64, device=dense.device),
        torch.arange(WORD_BITS, dtype=torch.int64, device=dense.device),
    )
    unsigned = (bits * weights).sum(dim=-1)  # in [0, 2**32), exact in int64
    signed = torch.where(unsigned >= 2**31, unsigned - 2**32, unsigned)  # two's complement wrap
    return signed.to(torch.int32)


def unpack_mask(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_mask`: int32 ``[..., W]`` -> bool ``[..., n]`` (requires ``n <= 32 * W``)."""
    if packed.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"unpack_mask expects int32 (or int64) words, got {packed.dtype}")
    n = operator.index(n)
    words = packed.shape[-1] if packed.dim() >= 1 else 0
    if n < 0 or n > words * WORD_BITS:
        raise ValueError(f"cannot unpack {n} columns from {words} word(s) of {WORD_BITS} bits")
    if packed.dtype == torch.int64:  # keep the low 32 bits, as two's-complement int32
        low = packed & 0xFFFFFFFF
        packed = torch.where(low >= 2**31, low - 2**32, low).to(torch.int32)
    return packed_mask_to_dense(packed, n)  # the one unpacker (export-friendly)


def chain_mask(n: int) -> Tensor:
    """int32 ``[n, ceil(n/32)]``: a chain (row ``i`` sees rows ``0..i``): prefill, or a linear draft."""
    n = operator.index(n)
    return pack_mask(torch.ones(n, n, dtype=torch.bool).tril())


def block_mask(q: int, causal: bool) -> Tensor:
    """int32 ``[q, ceil(q/32)]``: the draft-block rows of a head forward, causal or bidirectional."""
    q = operator.index(q)
    block = torch.ones(q, q, dtype=torch.bool)
    return pack_mask(block.tril() if causal else block)


def pack_mask_batch(masks: Sequence[Tensor], num_nodes: int | None = None) -> tuple[Tensor, Tensor]:
    """Square bool masks ``[n_b, n_b]`` (any sizes) -> int32 ``[B, N, ceil(N/32)]`` + int32 lengths ``[B]``.

    ``N`` is ``num_nodes`` (a fixed engine shape; must hold the largest mask) or the largest ``n_b``.
    Rows and columns at or past ``n_b`` are zero bits (padding: invisible, and seeing no node).
    """
    if len(masks) == 0:
        raise ValueError("pack_mask_batch needs at least one mask")
    sizes = []
    for i, m in enumerate(masks):
        if m.dtype != torch.bool or m.dim() != 2 or m.shape[0] != m.shape[1]:
            raise ValueError(f"mask {i} must be a square bool [n, n] tensor, got {m.dtype} {tuple(m.shape)}")
        sizes.append(int(m.shape[0]))
    n = max(sizes) if num_nodes is None else operator.index(num_nodes)
    if n < max(sizes):
        raise ValueError(f"num_nodes={n} is smaller than the largest mask ({max(sizes)} rows)")
    device = masks[0].device
    dense = torch.zeros(len(masks), n, n, dtype=torch.bool, device=device)
    for b, m in enumerate(masks):
        dense[b, : sizes[b], : sizes[b]] = m.to(device)
    return pack_mask(dense), torch.tensor(sizes, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class TreeBatchMasks:
    """A batch of trees as the batched verify graph takes them (TensorRT-LLM's spec-decoding tensors).

    Attributes:
        packed_mask: int32 ``[B, N, ceil(N/32)]`` ancestor-or-self masks; padding rows/columns zero.
        generation_lengths: int32 ``[B]`` nodes in use per request (``<= N``).
        position_offsets: int64 ``[B, N]`` node depths; 0 on padding rows.
    """

    packed_mask: Tensor
    generation_lengths: Tensor
    position_offsets: Tensor

    @property
    def batch_size(self) -> int:
        return int(self.packed_mask.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.packed_mask.shape[1])

    def position_ids(self, past_lengths: Tensor | Sequence[int]) -> Tensor:
        """int64 ``[B, N]``: ``past_lengths[b] + depth`` (padding rows: ``past_lengths[b]``, a valid position)."""
        past = torch.as_tensor(past_lengths, dtype=torch.int64, device=self.position_offsets.device)
        if past.shape != (self.batch_size,):
            raise ValueError(
                f"past_lengths must have one entry per request ({self.batch_size}), got {past.shape}"
            )
        return past.unsqueeze(1) + self.position_offsets


def pack_tree_batch(trees: Sequence[MaskedTree], num_nodes: int | None = None) -> TreeBatchMasks:
    """Pack a batch of trees of any sizes (a prompt chunk is :meth:`DraftTree.chain`) for one verify.

    ``N`` is ``num_nodes`` (>= the largest tree) or the largest tree's size. Request ``b``'s rows
    ``[0, n_b)`` are its tree (node order kept), the rest padding (see the module docstring).
    """
    if len(trees) == 0:
        raise ValueError("pack_tree_batch needs at least one tree")
    packed, lengths = pack_mask_batch([t.ancestor_mask() for t in trees], num_nodes)
    offsets = torch.zeros(packed.shape[0], packed.shape[1], dtype=torch.int64, device=packed.device)
    for b, tree in enumerate(trees):
        offsets[b, : tree.num_nodes] = tree.depths.to(packed.device)
    return TreeBatchMasks(packed_mask=packed, generation_lengths=lengths, position_offsets=offsets)
