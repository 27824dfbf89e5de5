"""`HeadCache`: the draft head's context K/V cache.

Holds, per head layer, the K and V of the fused target context rows, shape `[B, kv_heads, T, head_dim]`
(K after `k_norm` and RoPE at the context positions; V straight from `v_proj`). Block K/V are never
stored: each head forward recomputes its block. Between speculative-decoding rounds the caller appends
the newly committed rows' taps (`DraftHead.forward(context=new_taps, cache=cache)`), or `crop`s rows
that turned out to be rejected.
"""

from __future__ import annotations

import torch


class HeadCache:
    """Per-layer context K/V of a `DraftHead`; all layers always hold the same number of rows."""

    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = int(num_layers)
        self.keys: list[torch.Tensor | None] = [None] * self.num_layers
        self.values: list[torch.Tensor | None] = [None] * self.num_layers

    @property
    def length(self) -> int:
        """Context rows held (read from the last layer, so it only changes once every layer appended)."""
        k = self.keys[-1]
        return 0 if k is None else int(k.shape[2])

    def __len__(self) -> int:
        return self.length

    def layer_length(self, layer: int) -> int:
        k = self.keys[layer]
        return 0 if k is None else int(k.shape[2])

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `k`, `v` (`[B, kv_heads, T_new, head_dim]`) to `layer`; return that layer's full K, V."""
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(
                f"expected k, v of shape [B, kv_heads, T, head_dim], got {tuple(k.shape)}, {tuple(v.shape)}"
            )
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]

    def get(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.keys[layer], self.values[layer]

    def crop(self, n: int) -> None:
        """Keep the first `n` context rows (negative `n`: drop the last `-n` rows), like HF `Cache.crop`."""
        length = self.length
        keep = length + n if n < 0 else n
        keep = max(0, min(keep, length))
        if keep == length:
            return
        for i in range(self.num_layers):
            if self.keys[i] is None:
                continue
            if keep == 0:
                self.keys[i] = self.values[i] = None
            else:
                self.keys[i] = self.keys[i][:, :, :keep]
                self.values[i] = self.values[i][:, :, :keep]

    def reset(self) -> None:
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers

    def __repr__(self) -> str:
        return f"HeadCache(num_layers={self.num_layers}, length={self.length})"
