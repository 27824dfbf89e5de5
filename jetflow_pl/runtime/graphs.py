"""The two decode graphs: `TargetVerifyGraph` and `DraftHeadGraph` (contract: `jetflow_pl/runtime/contract.py`).

Both are thin `nn.Module`s over the live models' own submodules (projections, norms, MLPs, rotary
embeddings), with the KV caches as explicit tensors and attention as `jetflow::tree_attention`:

* variant `plugin`: attention is the custom op, which the exporter translates into one
  `jetflow::TreeAttention` node per layer (a TensorRT plugin, or an onnxruntime-extensions Python op);
* variant `portable`: attention is `tree_attention_reference`, which exports to standard ONNX ops;
* variant `attention`: the packed mask is unpacked in standard ops and each layer's attention is one
  opset-23 `Attention` node (the plugin-free TensorRT path through its `IAttention` layer).

`TargetVerifyGraph` / `DraftHeadGraph` have batch 1 (one sequence per forward: the TensorRT engines' form);
`BatchedTargetVerifyGraph` / `BatchedDraftHeadGraph` are the same computation over B requests with
per-request KV lengths (`contract.BATCHED_*`): the tree-attention op's `past_lengths` hides each request's
padding, its `[B, N, W]` packed mask holds each request's tree. The exporter turns them into ONNX graphs;
run eagerly they are `TorchGraphBackend`'s compute (on CUDA the op dispatches to the Triton kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from jetflow_pl.head import DraftHead
from jetflow_pl.head.draft_vocab import draft_vocab_of, restricted_lm_head
from jetflow_pl.ops.tree_attention import (
    tree_attention,
    tree_attention_grouped,
    tree_attention_via_masked_attention,
)
from jetflow_pl.target import TargetModel, has_sandwich_norms

AttentionFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float], Tensor]


def attention_for(variant: str) -> AttentionFn:
    """The attention implementation a graph variant is built from."""
    if variant == "plugin":
        return tree_attention
    if variant == "portable":
        return tree_attention_grouped
    if variant == "attention":
        return tree_attention_via_masked_attention
    raise ValueError(f"unknown export variant {variant!r}: expected 'plugin', 'portable' or 'attention'")


def _rotary_tables(target: TargetModel, x: Tensor, position_ids: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Per decoder layer, RoPE's (cos, sin) at `position_ids`: one table for a model with one RoPE, one
    per layer kind for a model whose local and global layers have their own bases (Gemma 3)."""
    rotary = target.model.model.rotary_emb
    types = list(getattr(target.config, "layer_types", None) or ["full_attention"] * target.num_layers)
    params = getattr(target.config, "rope_parameters", None) or {}
    if "full_attention" not in params:  # one RoPE for every layer
        table = rotary(x, position_ids)
        return [table] * target.num_layers
    tables = {kind: rotary(x, position_ids, kind) for kind in dict.fromkeys(types)}
    return [tables[kind] for kind in types]


def _layer_update(layer: nn.Module, x: Tensor, attention_out: Tensor) -> Tensor:
    """The residual stream after a decoder layer, given its attention's output projection.

    Llama/Qwen/Mistral: `x + attn; x + mlp(post_attention_layernorm(x))`. Gemma 3 ("sandwich" norms):
    `x + post_attention_layernorm(attn); x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`.
    """
    if has_sandwich_norms(layer):
        x = x + layer.post_attention_layernorm(attention_out)
        return x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
    x = x + attention_out
    return x + layer.mlp(layer.post_attention_layernorm(x))


class TargetVerifyGraph(nn.Module):
    """One target forward over `N` new rows (tree nodes, or a prompt as a chain) with an explicit KV cache.

    Inputs/outputs follow `contract.TARGET_INPUTS` / `TARGET_OUTPUTS`. Taps follow `TargetModel`: tap `i`
    is decoder layer `i`'s output, except the last layer, whose tap is the final-normed hidden state.
    A sliding-window layer's attention carries its window (`TargetModel.windows`; the op derives each
    row's position from the tree mask), so the graph needs no input beyond a full-attention model's.
    """

    def __init__(self, target: TargetModel, variant: str = "plugin") -> None:
        super().__init__()
        self.target = target
        self.attend = attention_for(variant)
        self.windows = tuple(w or 0 for w in target.windows)
        first = target.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.num_heads = int(target.config.num_attention_heads)
        self.num_kv_heads = int(target.config.num_key_value_heads)
        self.scaling = float(first.scaling)
        self.tap_layer_ids = tuple(target.tap_layer_ids)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        tree_mask: Tensor,
        past_keys: Tensor,
        past_values: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return self._run(input_ids, position_ids, tree_mask, past_keys, past_values)

    def _run(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        tree_mask: Tensor,
        past_keys: Tensor,
        past_values: Tensor,
        past_lengths: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        t = self.target
        x = t.embed_tokens(input_ids)
        b, n = x.shape[0], x.shape[1]
        extra = () if past_lengths is None else (past_lengths,)
        rope = _rotary_tables(t, x, position_ids)
        new_k, new_v, taps = [], [], {}
        last = t.num_layers - 1
        for i, layer in enumerate(t.layers):
            cos, sin = rope[i]
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, n, self.num_heads, self.head_dim)
            k = attn.k_proj(h).view(b, n, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(h).view(b, n, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # qwen3: per-head RMSNorm on q and k before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            window = {"window": self.windows[i]} if self.windows[i] else {}
            o = self.attend(q, past_keys[i], past_values[i], k, v, tree_mask, self.scaling, *extra, **window)
            x = _layer_update(
                layer, x, attn.o_proj(o.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))
            )
            new_k.append(k)
            new_v.append(v)
            if i in self.tap_layer_ids and i != last:
                taps[i] = x
        hidden = t.final_norm(x)
        taps[last] = hidden
        features = torch.cat([taps[i] for i in self.tap_layer_ids], dim=-1)
        logits = t.lm_head(hidden).float()
        return (
            logits,
            logits.argmax(dim=-1),
            features,
            # past ++ new as one concatenation of the whole cache (not one per layer and then a stack of
            # them: that wrote every KV row twice)
            torch.cat([past_keys, torch.stack(new_k)], dim=3),
            torch.cat([past_values, torch.stack(new_v)], dim=3),
        )


class BatchedTargetVerifyGraph(TargetVerifyGraph):
    """`TargetVerifyGraph` over B requests (`contract.BATCHED_TARGET_INPUTS`): request `b`'s committed KV
    rows are `[0, past_lengths[b])` of the padded `P`, its tree `tree_mask[b]` (`[B, N, W]`, padding rows
    and columns zero). `present_*` is `past ++ new` per request, padding included (the runtime compacts)."""

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        tree_mask: Tensor,
        past_lengths: Tensor,
        past_keys: Tensor,
        past_values: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return self._run(input_ids, position_ids, tree_mask, past_keys, past_values, past_lengths)


def own_rows_first(past_lengths: Tensor, context_lengths: Tensor, num_past, num_new) -> Tensor:
    """int64 `[B, P + T]`: per request, the indices of `past ++ new` that put its own rows first.

    Request `b`'s valid head-cache rows after a context update are `[0, past_lengths[b])` and
    `[P, P + context_lengths[b])` of the concatenation (the rest is padding of shorter requests). The
    tree-attention contract sees a *prefix* per request, so the attention reads the rows through this
    gather: `[0, past) ++ [P, P + ctx)` then the padding, which is a valid prefix of `past + ctx` rows
    (exactly where TensorRT-LLM's paged cache would have appended them). Plain Range/Less/Where ops.
    """
    j = torch.arange(num_past + num_new, dtype=torch.int64, device=past_lengths.device).unsqueeze(0)
    past = past_lengths.to(torch.int64).unsqueeze(1)
    ctx = context_lengths.to(torch.int64).unsqueeze(1)
    return torch.where(j < past, j, torch.where(j < past + ctx, j - past + num_past, j))


class DraftHeadGraph(nn.Module):
    """One draft-head forward: fuse new context taps, extend the head KV cache, attend, top-k per row.

    Inputs/outputs follow `contract.HEAD_INPUTS` / `HEAD_OUTPUTS`. The block rows see every context row
    (the cache plus the new rows) and the block rows allowed by `block_mask` (packed; causal, bidirectional
    or a tree). The target's embedding and lm_head are part of this graph, so it is self-contained.
    """

    def __init__(self, head: DraftHead, target: TargetModel, topk: int, variant: str = "plugin") -> None:
        super().__init__()
        head.check_compatible(target.config)
        head.match_dtype(target.dtype)
        vocab = draft_vocab_of(head)
        scored = target.vocab_size if vocab is None else int(vocab.numel())
        if topk < 1 or topk > scored:
            raise ValueError(f"topk must be in [1, {scored}] (the tokens the head drafts from), got {topk}")
        self.head = head
        self.embed_tokens = target.embed_tokens
        self.lm_head = target.lm_head
        self.register_buffer("draft_vocab", None, persistent=False)
        if vocab is not None:  # the draft vocabulary's rows of the lm_head, baked into the graph
            self.lm_head = restricted_lm_head(target.lm_head, vocab)
            self.draft_vocab = vocab.to(target.lm_head.weight.device)
        self.topk = int(topk)
        self.attend = attention_for(variant)
        first = head.layers[0].self_attn
        self.scaling = float(first.scaling)
        self.num_heads = int(first.num_heads)
        self.head_dim = int(first.head_dim)

    def forward(
        self,
        context_taps: Tensor,
        context_positions: Tensor,
        block_ids: Tensor,
        block_positions: Tensor,
        block_mask: Tensor,
        past_keys: Tensor,
        past_values: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self._run(
            context_taps, context_positions, block_ids, block_positions, block_mask, past_keys, past_values
        )

    def _run(
        self,
        context_taps: Tensor,
        context_positions: Tensor,
        block_ids: Tensor,
        block_positions: Tensor,
        block_mask: Tensor,
        past_keys: Tensor,
        past_values: Tensor,
        past_lengths: Tensor | None = None,
        context_lengths: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        head = self.head
        c = head.fuse(context_taps)
        ctx_emb = head.rotary_emb(c, context_positions)
        x = self.embed_tokens(block_ids).to(c.dtype)
        b, q_rows = x.shape[0], x.shape[1]
        order = visible = None
        if past_lengths is not None and context_lengths is not None:
            p, t = past_keys.shape[3], context_taps.shape[1]
            order = own_rows_first(past_lengths, context_lengths, p, t)
            visible = (past_lengths.to(torch.int64) + context_lengths.to(torch.int64)).to(torch.int32)
        pos_emb = head.rotary_emb(x, block_positions)
        presents_k, presents_v = [], []
        for i, layer in enumerate(head.layers):
            attn = layer.self_attn
            ck, cv = attn.context_kv(c, ctx_emb)
            pk = torch.cat([past_keys[i], ck], dim=2)
            pv = torch.cat([past_values[i], cv], dim=2)
            q, k, v = attn.project(layer.input_layernorm(x), pos_emb)
            if order is None:
                o = self.attend(q, pk, pv, k, v, block_mask, self.scaling)
            else:
                index = order[:, None, :, None].expand(pk.shape)
                ak, av = torch.gather(pk, 2, index), torch.gather(pv, 2, index)
                o = self.attend(q, ak, av, k, v, block_mask, self.scaling, visible)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, q_rows, self.num_heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            presents_k.append(pk)
            presents_v.append(pv)
        logprobs = torch.log_softmax(self.lm_head(head.norm(x)).float(), dim=-1)
        values, ids = torch.topk(logprobs, self.topk, dim=-1)
        if self.draft_vocab is not None:  # draft-vocabulary columns -> target token ids
            ids = self.draft_vocab[ids]
        return values, ids, torch.stack(presents_k), torch.stack(presents_v)


class BatchedDraftHeadGraph(DraftHeadGraph):
    """`DraftHeadGraph` over B requests (`contract.BATCHED_HEAD_INPUTS`): request `b` has
    `past_lengths[b]` committed head-cache rows (of the padded `P`) and `context_lengths[b]` new context
    rows (of `T`; the rest zero padding). The block rows attend to the request's own rows only
    (`own_rows_first`); `present_*` is `past ++ new` per request, padding included (the runtime keeps
    each request's rows)."""

    def forward(
        self,
        context_taps: Tensor,
        context_positions: Tensor,
        context_lengths: Tensor,
        block_ids: Tensor,
        block_positions: Tensor,
        block_mask: Tensor,
        past_lengths: Tensor,
        past_keys: Tensor,
        past_values: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self._run(
            context_taps,
            context_positions,
            block_ids,
            block_positions,
            block_mask,
            past_keys,
            past_values,
            past_lengths,
            context_lengths,
        )


def decode_graphs(head: DraftHead, target: TargetModel, topk: int, variant: str, batched: bool):
    """(verify graph, head graph) modules of a variant, batch-1 or batched."""
    if batched:
        return BatchedTargetVerifyGraph(target, variant), BatchedDraftHeadGraph(head, target, topk, variant)
    return TargetVerifyGraph(target, variant), DraftHeadGraph(head, target, topk, variant)


def pair_config(head: DraftHead, target: TargetModel, topk: int) -> dict[str, Any]:
    """What a graph runtime needs to know about a (head, target) pair: the model part of `config.json`."""
    cfg = target.config
    attn = head.layers[0].self_attn
    eos = cfg.eos_token_id
    return {
        "block_size": int(head.config.block_size),
        "mask_token_id": int(head.config.mask_token_id),
        "causal_head": bool(head.config.causal_head),
        "topk": int(topk),
        "vocab_size": int(target.vocab_size),
        "max_positions": int(cfg.max_position_embeddings),
        "eos_token_id": eos if isinstance(eos, list) else ([] if eos is None else [int(eos)]),
        "target_layer_ids": list(head.config.target_layer_ids),
        "target": {
            "model_type": cfg.model_type,
            "num_layers": target.num_layers,
            "num_heads": int(cfg.num_attention_heads),
            "num_kv_heads": int(cfg.num_key_value_heads),
            "head_dim": int(target.layers[0].self_attn.head_dim),
            "hidden_size": target.hidden_size,
            # per layer: its sliding window, 0 for a global layer (carried by the TreeAttention nodes)
            "sliding_windows": [int(w or 0) for w in target.windows],
        },
        "head": {
            "num_layers": len(head.layers),
            "num_heads": int(attn.num_heads),
            "num_kv_heads": int(attn.num_kv_heads),
            "head_dim": int(attn.head_dim),
            "hidden_size": int(head.config.hidden_size),
            "tap_features": int(head.config.num_taps * head.config.target_hidden_size),
            "draft_vocab_size": int(getattr(head.config, "draft_vocab_size", 0) or 0),
        },
    }
