"""`GraphBackend`: decode-loop bookkeeping for backends that run the two decode graphs.

The graphs (`jetflow_pl/runtime/graphs.py`, contract in `jetflow_pl/runtime/contract.py`) take explicit KV caches
and return `past ++ new` rows. This class owns what every such runtime does the same way: the target KV
cache and the head's context KV cache as tensors, appending (the graphs' `present_*`) and compacting
(root + accepted rows) after each round, the taps of committed rows queued until the next `draft`, the
chain-mask prefill (`P = 0`), and turning the head's per-row top-k into the per-depth log-probs the tree
builder reads. Subclasses only run a graph: `OnnxRuntimeBackend` (ONNX Runtime sessions) and
`TorchGraphBackend` (the same graphs eagerly in torch; on CUDA the attention op is the Triton kernel).
Same protocol and semantics as `TorchBackend` (see its docstring).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from jetflow_pl.tree import DraftTree, pack_mask


def chain_mask(n: int) -> Tensor:
    """Packed causal mask of `n` rows (a prompt prefilled as a chain)."""
    return pack_mask(torch.ones(n, n, dtype=torch.bool).tril())


class GraphBackend:
    """Speculative or autoregressive decoding over a head graph and a verify graph (batch 1)."""

    def __init__(self, config: dict[str, Any], device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        t, h = config["target"], config["head"]
        self._empty_target_kv = torch.zeros(
            t["num_layers"], 1, t["num_kv_heads"], 0, t["head_dim"], device=self.device
        )
        self._empty_head_kv = torch.zeros(
            h["num_layers"], 1, h["num_kv_heads"], 0, h["head_dim"], device=self.device
        )
        b = self.block_size
        block = torch.ones(b, b, dtype=torch.bool)
        self._block_mask = pack_mask(block.tril() if config["causal_head"] else block).to(self.device)
        self._mask_token_id = int(config["mask_token_id"])
        self._vocab = int(config["vocab_size"])
        self._reset()

    # ------------------------------------------------------------------ graph runners (subclasses)
    def run_target(self, feeds: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Verify graph -> (logits [1,N,V], taps [1,N,F], present_keys, present_values)."""
        raise NotImplementedError

    def run_head(self, feeds: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Head graph -> (topk_logprobs [1,Q,K], topk_ids [1,Q,K], present_keys, present_values)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ properties
    @property
    def block_size(self) -> int:
        return int(self.config["block_size"])

    @property
    def past_len(self) -> int:
        return self._past_len

    @property
    def max_positions(self) -> int:
        return int(self.config["max_positions"])

    @property
    def topk(self) -> int:
        return int(self.config["topk"])

    def check_width(self, width: int) -> None:
        """The head graph keeps `topk` tokens per depth: a wider tree cannot be built from it."""
        if width > self.topk:
            raise ValueError(
                f"tree width {width} exceeds the engine's top-k ({self.topk}): re-export with --topk >= {width}"
            )

    # ------------------------------------------------------------------ protocol
    def _reset(self) -> None:
        self._kv = (self._empty_target_kv, self._empty_target_kv)
        self._head_kv = (self._empty_head_kv, self._empty_head_kv)
        self._pending_taps: Tensor | None = None
        self._pending_pos: Tensor | None = None
        self._tree_out: tuple[Tensor, Tensor, Tensor] | None = None
        self._past_len = 0

    def _verify_rows(self, ids: Tensor, positions: Tensor, mask: Tensor):
        logits, taps, keys, values = self.run_target(
            {
                "input_ids": ids.reshape(1, -1).to(self.device, torch.long),
                "position_ids": positions.reshape(1, -1).to(self.device, torch.long),
                "tree_mask": mask.to(self.device, torch.int32),
                "past_keys": self._kv[0],
                "past_values": self._kv[1],
            }
        )
        return logits[0], taps, keys, values

    @torch.no_grad()
    def prefill(self, prompt_ids: Tensor) -> Tensor:
        ids = torch.as_tensor(prompt_ids).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("prompt is empty: at least one token is needed to start decoding")
        self._reset()
        n = ids.numel()
        logits, taps, keys, values = self._verify_rows(ids, torch.arange(n), chain_mask(n))
        self._kv = (keys, values)
        self._past_len = n
        self._pending_taps, self._pending_pos = taps, torch.arange(n, device=self.device)[None]
        return logits[-1].float().cpu()

    @torch.no_grad()
    def draft(self, anchor_token: int) -> Tensor:
        if self._pending_taps is None:
            raise RuntimeError("draft() needs new context rows: call prefill() or commit() first")
        b = self.block_size
        block = torch.full((1, b), self._mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = anchor_token
        values, ids, keys, vals = self.run_head(
            {
                "context_taps": self._pending_taps,
                "context_positions": self._pending_pos,
                "block_ids": block,
                "block_positions": (self._past_len + torch.arange(b, device=self.device))[None],
                "block_mask": self._block_mask,
                "past_keys": self._head_kv[0],
                "past_values": self._head_kv[1],
            }
        )
        self._head_kv = (keys, vals)
        self._pending_taps = self._pending_pos = None
        # the tree builder reads per-depth log-probs over the vocabulary: scatter the top-k into a -inf
        # row (rows 1.. of the block are depths 1..B-1)
        dense = torch.full((b - 1, self._vocab), float("-inf"))
        dense.scatter_(1, ids[0, 1:].long().cpu(), values[0, 1:].float().cpu())
        return dense

    @torch.no_grad()
    def verify(self, tree: DraftTree) -> Tensor:
        logits, taps, keys, values = self._verify_rows(
            tree.tokens, tree.position_ids(self._past_len), tree.packed_mask()
        )
        self._tree_out = (taps, keys, values)
        return logits.float().cpu()

    def commit(self, accepted: list[int]) -> None:
        if self._tree_out is None:
            raise RuntimeError("commit() without a preceding verify()")
        taps, keys, values = self._tree_out
        p = self._past_len
        keep = torch.as_tensor(accepted, dtype=torch.long, device=self.device)
        rows = p + keep
        self._kv = (
            torch.cat([keys[:, :, :, :p], keys[:, :, :, rows]], dim=3),
            torch.cat([values[:, :, :, :p], values[:, :, :, rows]], dim=3),
        )
        new_taps = taps[:, keep]
        new_pos = (p + torch.arange(len(accepted), device=self.device))[None]
        if self._pending_taps is None:
            self._pending_taps, self._pending_pos = new_taps, new_pos
        else:
            self._pending_taps = torch.cat([self._pending_taps, new_taps], dim=1)
            self._pending_pos = torch.cat([self._pending_pos, new_pos], dim=1)
        self._tree_out = None
        self._past_len += len(accepted)


class TorchGraphBackend(GraphBackend):
    """The decode graphs run eagerly in torch on any device: the reference for exported runtimes, and the
    torch GPU path whose tree attention is the `jetflow::tree_attention` op (Triton kernel on CUDA)."""

    def __init__(self, target, head, topk: int = 8, variant: str = "plugin") -> None:
        from jetflow_pl.runtime.graphs import DraftHeadGraph, TargetVerifyGraph, pair_config

        head.check_compatible(target.config)
        if list(target.tap_layer_ids) != list(head.config.target_layer_ids):
            target.set_taps(head.config.target_layer_ids)
        self._target_graph = TargetVerifyGraph(target, variant).eval()
        self._head_graph = DraftHeadGraph(head, target, topk, variant).eval()
        super().__init__(pair_config(head, target, topk), device=target.device)

    def run_target(self, feeds):
        logits, _argmax, taps, keys, values = self._target_graph(**feeds)
        return logits, taps, keys, values

    def run_head(self, feeds):
        return self._head_graph(**feeds)
