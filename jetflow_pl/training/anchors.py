"""Anchor sampling for distillation: where the training blocks start.

A block anchored at position `p` is `[input_ids[p], MASK * (block_size - 1)]`; its offset `k` predicts the
token at `p + k`. An anchor is eligible when `loss_mask[p]` is true and the whole block `p .. p+block_size-1`
lies inside the sequence and inside one document (packing).
"""

from __future__ import annotations

import torch


def segment_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """`[B, S]` document ids -> `[B, S]` contiguous segment ids (0, 1, 2, ... per row).

    A document is a maximal run of equal ids: a new segment starts wherever the id changes, so two runs
    that reuse the same id (e.g. `0 0 1 1 0 0`) are still different documents.
    """
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must be [B, S], got {tuple(doc_ids.shape)}")
    change = torch.zeros_like(doc_ids, dtype=torch.long)
    change[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).long()
    return change.cumsum(dim=1)


def eligible_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor | None, block_size: int) -> torch.Tensor:
    """`[B, S]` bool: positions that may anchor a block (see module docstring)."""
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B, S], got {tuple(loss_mask.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    B, S = loss_mask.shape
    ok = loss_mask.bool().clone()
    if block_size > S:
        return torch.zeros_like(ok)
    last = S - block_size  # the last anchor whose block still fits in the sequence
    ok[:, last + 1 :] = False
    if doc_ids is not None:
        if doc_ids.shape != loss_mask.shape:
            raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must match loss_mask {tuple(loss_mask.shape)}")
        seg = segment_ids(doc_ids)
        # segments are contiguous and non-decreasing: the block stays in one document iff the segment
        # of its last row equals the segment of its anchor
        same = torch.zeros_like(ok)
        same[:, : last + 1] = seg[:, block_size - 1 :] == seg[:, : last + 1]
        ok &= same
    return ok


def sample_anchors(
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor | None,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to `num_anchors` distinct eligible anchors per row, uniformly without replacement.

    Returns `(anchors [B, A] long, valid [B, A] bool)` with `A = num_anchors`. Each row's valid anchors
    come first, sorted ascending; the remaining slots (fewer eligible positions than `A`) hold anchor 0
    with `valid=False`. Every call draws afresh from `generator` (the global RNG when `None`), so a
    training loop re-samples its anchors every step.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    ok = eligible_anchors(loss_mask, doc_ids, block_size)
    B, S = ok.shape
    device = ok.device
    keys = torch.rand(B, S, generator=generator, device=device)
    keys = keys.masked_fill(~ok, 2.0)  # ineligible positions sort after every eligible one
    k = min(num_anchors, S)
    picked_keys, picked = torch.topk(keys, k, dim=1, largest=False)
    valid = picked_keys < 1.5
    # sort ascending by position, invalid slots last
    order_key = torch.where(valid, picked, torch.full_like(picked, S))
    order_key, order = torch.sort(order_key, dim=1)
    valid = torch.gather(valid, 1, order)
    anchors = torch.where(valid, order_key, torch.zeros_like(order_key))
    if k < num_anchors:
        pad = num_anchors - k
        anchors = torch.cat([anchors, anchors.new_zeros(B, pad)], dim=1)
        valid = torch.cat([valid, valid.new_zeros(B, pad)], dim=1)
    return anchors, valid
