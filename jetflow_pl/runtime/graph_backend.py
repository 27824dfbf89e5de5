"""`GraphBackend`: the decode protocol over the two decode graphs (`graphs.py`, contract in `contract.py`).

The graphs take explicit KV caches and return `past ++ new` rows (`present_*`), the prefill is the verify
graph over a chain mask, and the head graph keeps the top-k tokens of each row. This class turns that
contract into `SequenceBackend`'s two forwards: the feeds by name, the packed masks (`jetflow_pl.masks`),
the top-k scattered into the per-depth log-probs the tree builder reads. Its KV store defaults to
`TensorKVStore` (the graphs' outputs are the new caches). Subclasses only run a graph: `run_target` /
`run_head` (`OnnxRuntimeBackend`: ONNX Runtime sessions; `TorchGraphBackend`: the same graphs eagerly in
torch, on CUDA with the Triton kernel; `TensorRTBackend`: engines bound to preallocated buffers).

Two graph layouts (`contract.graph_io`): the batch-1 graphs (`[1, ...]` inputs, `max_batch` 1: a batch
is refused) and the batched graphs (`config["batched"]`), which take the whole decoding batch in one
forward: per-request ids/positions/packed masks (`TargetStep.masks`, TensorRT-LLM's layout), the padded
KV of the store's batch group and each request's `past_lengths` (and the head's `context_lengths`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from jetflow_pl.masks import block_mask, chain_mask
from jetflow_pl.runtime.kv_store import KVGroup, KVStore, TensorKVStore
from jetflow_pl.runtime.sequence import HeadStep, SequenceBackend, TapQueue, TargetStep, topk_to_dense


class GraphBackend(SequenceBackend):
    """Speculative or autoregressive decoding over a head graph and a verify graph.

    `config` is the model part of an engine directory's `config.json` (`graphs.pair_config`, plus
    `batched` / `max_batch` for the batched graphs). `max_batch`: request slots (default: the config's
    `max_batch`, 1 for batch-1 graphs, which take no more).
    """

    def __init__(
        self,
        config: dict[str, Any],
        device: torch.device | str = "cpu",
        kv: KVStore | None = None,
        head_kv: KVStore | None = None,
        taps: TapQueue | None = None,
        max_batch: int | None = None,
    ) -> None:
        self.config = config
        device = torch.device(device)
        self.batched = bool(config.get("batched", False))
        slots = int(config.get("max_batch", 1)) if max_batch is None else int(max_batch)
        if slots < 1:
            raise ValueError(f"max_batch must be >= 1, got {slots}")
        if slots > 1 and not self.batched:
            raise ValueError(
                f"max_batch {slots} needs the batched graphs: these graphs take one request per forward "
                "(re-export with jetflow-export --max-batch N)"
            )
        t, h = config["target"], config["head"]

        def store(dims: dict[str, Any]) -> TensorKVStore:
            # the batched graphs take every row's length, so their caches may carry padding past the
            # longest row (`TensorKVGroup`: a tree round's output is not cut and copied dense every round)
            layout = (dims["num_layers"], dims["num_kv_heads"], dims["head_dim"])
            return TensorKVStore(*layout, device, num_slots=slots, keep_slack=self.batched)

        kv = store(t) if kv is None else kv
        head_kv = store(h) if head_kv is None else head_kv
        # packed in-block masks by block rows, on the device: the full block's, and each cut block's
        # (`SequenceBackend.block_rows`) once it is first drafted, so no round rebuilds or copies one
        self._block_masks = {
            self.block_size: block_mask(self.block_size, bool(config["causal_head"])).to(device)
        }
        super().__init__(kv, head_kv, taps, device)

    # ------------------------------------------------------------------ graph runners (subclasses)
    def run_target(self, feeds: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Verify graph -> (logits [R,N,V], taps [R,N,F], present_keys, present_values); R = 1 for the
        batch-1 graphs."""
        raise NotImplementedError

    def run_head(self, feeds: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Head graph -> (topk_logprobs [R,Q,K], topk_ids [R,Q,K], present_keys, present_values)."""
        raise NotImplementedError

    def host_logits(self, logits: Tensor) -> Tensor:
        """Logits as the decode loop receives them (float32 on the host; a GPU runtime may keep them)."""
        return logits.float().cpu()

    # ------------------------------------------------------------------ what the runtime states
    @property
    def block_size(self) -> int:
        return int(self.config["block_size"])

    @property
    def causal_head(self) -> bool:
        return bool(self.config["causal_head"])

    def _block_mask_rows(self, q: int) -> Tensor:
        """The packed in-block mask of a block of `q` rows (shorter than the block for a causal head's cut
        draft, `SequenceBackend.block_rows`)."""
        mask = self._block_masks.get(q)
        if mask is None:
            mask = self._block_masks[q] = block_mask(q, self.causal_head).to(self.device)
        return mask

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
    def _one_request(self, group: KVGroup) -> None:
        """The batch-1 graphs take one request per forward (`[1, ...]` inputs): a batch is refused."""
        if group.size != 1 and not self.batched:
            raise RuntimeError(
                f"the decode graphs run one request per forward, got a batch of {group.size} "
                "(this backend has max_batch 1)"
            )

    def _forward_target(self, step: TargetStep, group: KVGroup):
        self._one_request(group)
        past_keys, past_values = group.past()  # type: ignore[attr-defined]
        dev = self.device
        if self.batched:  # TensorRT-LLM's spec-decoding inputs: [R, N, W] masks, per-request KV lengths
            feeds = {
                "input_ids": step.ids.to(dev, torch.long),
                "position_ids": step.positions.to(dev, torch.long),
                "tree_mask": step.masks.packed_mask.to(dev, torch.int32),
                "past_lengths": step.past_lengths.to(dev, torch.int32),
            }
        else:
            n = step.num_rows
            mask = step.trees[0].packed_mask() if step.trees is not None else chain_mask(n)
            feeds = {
                "input_ids": step.ids.reshape(1, -1).to(dev, torch.long),
                "position_ids": step.positions.reshape(1, -1).to(dev, torch.long),
                "tree_mask": mask.to(dev, torch.int32),
            }
        logits, taps, keys, values = self.run_target(
            {**feeds, "past_keys": past_keys, "past_values": past_values}
        )
        return self.host_logits(logits[:, -1:] if step.last_only else logits), taps, (keys, values)

    def _forward_head(self, step: HeadStep, group: KVGroup):
        self._one_request(group)
        past_keys, past_values = group.past()  # type: ignore[attr-defined]
        feeds = {
            "context_taps": step.context_taps,
            "context_positions": step.context_positions,
            "block_ids": step.block_ids,
            "block_positions": step.block_positions,
            "block_mask": self._block_mask_rows(int(step.block_ids.shape[1])),
        }
        if self.batched:
            dev = self.device
            feeds["context_lengths"] = step.context_lengths.to(dev, torch.int32)
            feeds["past_lengths"] = step.past_lengths.to(dev, torch.int32)
        values, ids, keys, vals = self.run_head({**feeds, "past_keys": past_keys, "past_values": past_values})
        # rows 1.. of the block are depths 1..B-1 (offset 0 predicts nothing)
        return topk_to_dense(values[:, 1:], ids[:, 1:], self.vocab_size), (keys, vals)


class TorchGraphBackend(GraphBackend):
    """The decode graphs run eagerly in torch on any device: the reference for exported runtimes, and the
    torch GPU path whose tree attention is the `jetflow::tree_attention` op (Triton kernel on CUDA)."""

    def __init__(self, target, head, topk: int = 8, variant: str = "plugin", max_batch: int = 1) -> None:
        """`max_batch > 1` runs the batched graphs (`graphs.BatchedTargetVerifyGraph` ...) over that
        many request slots; 1 the batch-1 graphs the TensorRT engines are built from."""
        from jetflow_pl.runtime.graphs import decode_graphs, pair_config

        head.check_compatible(target.config)
        if list(target.tap_layer_ids) != list(head.config.target_layer_ids):
            target.set_taps(head.config.target_layer_ids)
        batched = int(max_batch) > 1
        target_graph, head_graph = decode_graphs(head, target, topk, variant, batched)
        self._target_graph, self._head_graph = target_graph.eval(), head_graph.eval()
        config = {**pair_config(head, target, topk), "batched": batched, "max_batch": int(max_batch)}
        super().__init__(config, device=target.device)

    def run_target(self, feeds):
        logits, _argmax, taps, keys, values = self._target_graph(**feeds)
        return logits, taps, keys, values

    def run_head(self, feeds):
        return self._head_graph(**feeds)
