"""`GraphBackend`: the decode protocol over the two decode graphs (`graphs.py`, contract in `contract.py`).

The graphs take explicit KV caches and return `past ++ new` rows (`present_*`), the prefill is the verify
graph over a chain mask, and the head graph keeps the top-k tokens of each row. This class turns that
contract into `SequenceBackend`'s two forwards: the feeds by name, the packed masks (`jetflow_pl.masks`),
the top-k scattered into the per-depth log-probs the tree builder reads. Its KV store defaults to
`TensorKVStore` (the graphs' outputs are the new caches). Subclasses only run a graph: `run_target` /
`run_head` (`OnnxRuntimeBackend`: ONNX Runtime sessions; `TorchGraphBackend`: the same graphs eagerly in
torch, on CUDA with the Triton kernel; `TensorRTBackend`: engines bound to preallocated buffers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from jetflow_pl.masks import block_mask, chain_mask
from jetflow_pl.runtime.kv_store import KVStore, TensorKVStore
from jetflow_pl.runtime.sequence import SequenceBackend, TapQueue, topk_to_dense
from jetflow_pl.tree import DraftTree


class GraphBackend(SequenceBackend):
    """Speculative or autoregressive decoding over a head graph and a verify graph (batch 1).

    `config` is the model part of an engine directory's `config.json` (`graphs.pair_config`).
    """

    def __init__(
        self,
        config: dict[str, Any],
        device: torch.device | str = "cpu",
        kv: KVStore | None = None,
        head_kv: KVStore | None = None,
        taps: TapQueue | None = None,
    ) -> None:
        self.config = config
        device = torch.device(device)
        t, h = config["target"], config["head"]
        if kv is None:
            kv = TensorKVStore(t["num_layers"], t["num_kv_heads"], t["head_dim"], device)
        if head_kv is None:
            head_kv = TensorKVStore(h["num_layers"], h["num_kv_heads"], h["head_dim"], device)
        self._block_mask = block_mask(self.block_size, bool(config["causal_head"])).to(device)
        super().__init__(kv, head_kv, taps, device)

    # ------------------------------------------------------------------ graph runners (subclasses)
    def run_target(self, feeds: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Verify graph -> (logits [1,N,V], taps [1,N,F], present_keys, present_values)."""
        raise NotImplementedError

    def run_head(self, feeds: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Head graph -> (topk_logprobs [1,Q,K], topk_ids [1,Q,K], present_keys, present_values)."""
        raise NotImplementedError

    def host_logits(self, logits: Tensor) -> Tensor:
        """Logits as the decode loop receives them (float32 on the host; a GPU runtime may keep them)."""
        return logits.float().cpu()

    # ------------------------------------------------------------------ what the runtime states
    @property
    def block_size(self) -> int:
        return int(self.config["block_size"])

    @property
    def mask_token_id(self) -> int:
        return int(self.config["mask_token_id"])

    @property
    def max_positions(self) -> int:
        return int(self.config["max_positions"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def topk(self) -> int:
        """The head graph keeps `topk` tokens per depth: `check_width` refuses a wider tree."""
        return int(self.config["topk"])

    # ------------------------------------------------------------------ the two forwards
    def _forward_target(self, ids: Tensor, positions: Tensor, tree: DraftTree | None, last_only: bool):
        n = int(ids.numel())
        mask = tree.packed_mask() if tree is not None else chain_mask(n)
        past_keys, past_values = self.kv.past()
        logits, taps, keys, values = self.run_target(
            {
                "input_ids": ids.reshape(1, -1).to(self.device, torch.long),
                "position_ids": positions.reshape(1, -1).to(self.device, torch.long),
                "tree_mask": mask.to(self.device, torch.int32),
                "past_keys": past_keys,
                "past_values": past_values,
            }
        )
        return self.host_logits(logits[0, -1:] if last_only else logits[0]), taps, (keys, values)

    def _forward_head(self, block_ids: Tensor, block_positions: Tensor, context: tuple[Tensor, Tensor]):
        taps, positions = context
        past_keys, past_values = self.head_kv.past()
        values, ids, keys, vals = self.run_head(
            {
                "context_taps": taps,
                "context_positions": positions,
                "block_ids": block_ids,
                "block_positions": block_positions,
                "block_mask": self._block_mask,
                "past_keys": past_keys,
                "past_values": past_values,
            }
        )
        # rows 1.. of the block are depths 1..B-1 (offset 0 predicts nothing)
        return topk_to_dense(values[0, 1:], ids[0, 1:], self.vocab_size), (keys, vals)


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
