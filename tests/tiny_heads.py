"""A fresh draft head for the tiny random target, with perturbed norms (checks then see the norms)."""

from __future__ import annotations

import torch

from jetflow_pl.head import DraftHead, DraftHeadConfig
from jetflow_pl.target import TargetModel


def perturbed_head(
    target: TargetModel,
    mask_id: int,
    block_size: int = 4,
    causal: bool = True,
    seed: int = 0,
    layers: int = 1,
) -> DraftHead:
    """A seeded `layers`-layer head fitting `target`, its norm weights moved off 1 so that a check that
    skipped a norm would see the difference (train mode, as built)."""
    torch.manual_seed(seed)
    cfg = DraftHeadConfig.for_target(
        target.config, num_hidden_layers=layers, block_size=block_size, causal=causal, mask_token_id=mask_id
    )
    head = DraftHead(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return head
