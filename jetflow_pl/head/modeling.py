"""`DraftHead`: the JetFlow / DFlash parallel draft head.

A stack of Qwen3-style decoder layers without embedding or lm_head. Per forward:

1. the new raw target taps `context` `[B, T, n*Ht]` are fused once: `c = hidden_norm(fc(taps))`;
2. every layer attends from the block rows (queries) over `[context K/V ; block K/V]`, where the
   context K/V come from THAT layer's `k_proj`/`v_proj` applied to `c` (`k_norm` + RoPE at the context
   positions on K). `c` never goes through a layer's norms or MLP;
3. the final-normed block hidden states `[B, Q, H]` are returned; the caller applies the target's
   (frozen) lm_head.

Parameter names follow the DFlash/JetSpec checkpoints: `fc`, `hidden_norm`, `layers.{i}.{input_layernorm,
self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}`,
`norm` (and the parameter-free `rotary_emb`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
    rotate_half,
)

from .cache import HeadCache
from .configuration import DraftHeadConfig

InBlock = str | torch.Tensor | None

IN_BLOCK_MODES = ("causal", "bidirectional")


def make_block(anchor_ids: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """`[B]` anchor ids -> `[B, block_size]` block `[anchor, MASK, ..., MASK]` (same dtype/device)."""
    if mask_token_id is None:
        raise ValueError("mask_token_id is not set (dflash_config.mask_token_id)")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    anchor_ids = torch.as_tensor(anchor_ids).reshape(-1)
    block = torch.full(
        (anchor_ids.shape[0], block_size),
        int(mask_token_id),
        dtype=anchor_ids.dtype,
        device=anchor_ids.device,
    )
    block[:, 0] = anchor_ids
    return block


def _rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on one `[B, heads, T, d]` tensor with `[B, T, d]` cos/sin."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DraftAttention(nn.Module):
    """Block queries over `[context K/V prefix ; block K/V]` (GQA, per-head q/k RMSNorm, RoPE, SDPA)."""

    def __init__(self, config: DraftHeadConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} must be a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        self.num_kv_groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = float(config.attention_dropout)
        bias = bool(config.attention_bias)
        H = config.hidden_size
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def context_kv(
        self, context: torch.Tensor, context_pos_emb: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused context `[B, T, H]` -> this layer's K, V `[B, kv_heads, T, head_dim]` (K normed + rotated)."""
        B, T, _ = context.shape
        k = self.k_norm(self.k_proj(context).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(context).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = context_pos_emb
        return _rope_one(k, cos, sin), v

    def project(
        self, hidden_states: torch.Tensor, pos_emb: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block rows `[B, Q, H]` -> q `[B, heads, Q, d]`, k, v `[B, kv_heads, Q, d]` (normed, rotated).

        Shared by `forward` and the export graphs, so both compute the same projections.
        """
        B, Q, _ = hidden_states.shape
        q = self.q_norm(self.q_proj(hidden_states).view(B, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(B, Q, self.num_kv_heads, self.head_dim)).transpose(
            1, 2
        )
        v = self.v_proj(hidden_states).view(B, Q, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = pos_emb
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def forward(
        self,
        hidden_states: torch.Tensor,
        pos_emb: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        context: torch.Tensor | None = None,
        context_pos_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: HeadCache | None = None,
    ) -> torch.Tensor:
        B, Q, _ = hidden_states.shape
        q, k, v = self.project(hidden_states, pos_emb)

        ck = cv = None
        if context is not None:
            ck, cv = self.context_kv(context, context_pos_emb)
        if cache is not None:
            if ck is not None:
                ck, cv = cache.append(self.layer_idx, ck, cv)
            else:
                ck, cv = cache.get(self.layer_idx)
        if ck is not None:
            k = torch.cat([ck.to(k.dtype), k], dim=2)
            v = torch.cat([cv.to(v.dtype), v], dim=2)

        k = repeat_kv(k, self.num_kv_groups)
        v = repeat_kv(v, self.num_kv_groups)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            scale=self.scaling,
        )
        out = out.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim)
        return self.o_proj(out)


class DraftDecoderLayer(nn.Module):
    """Pre-norm decoder layer; the fused context only feeds `self_attn`'s k/v projections."""

    def __init__(self, config: DraftHeadConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        pos_emb: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        context: torch.Tensor | None = None,
        context_pos_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: HeadCache | None = None,
    ) -> torch.Tensor:
        h = self.self_attn(
            self.input_layernorm(hidden_states), pos_emb, mask, context, context_pos_emb, cache
        )
        hidden_states = hidden_states + h
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DraftHead(PreTrainedModel):
    """Parallel draft head (JetFlow causal / DFlash bidirectional). See module docstring."""

    config_class = DraftHeadConfig
    config: DraftHeadConfig
    base_model_prefix = ""
    main_input_name = "block_embeds"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DraftDecoderLayer"]
    # a head folder written for vLLM carries its draft vocabulary as `d2t` offsets plus the target's lm_head
    # rows; `checkpoints.load_draft_head` reads the offsets, the rows are the target's own
    _keys_to_ignore_on_load_unexpected = [r"^d2t$", r"^lm_head\.weight$"]
    _keys_to_ignore_on_load_missing = [r"^draft_vocab$"]

    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__(config)
        if config.num_taps < 1:
            raise ValueError(
                "dflash_config.target_layer_ids is empty: set it (or num_target_layers) before building a DraftHead"
            )
        self.fc = nn.Linear(config.num_taps * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DraftDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        if int(config.draft_vocab_size or 0) > 0:  # filled by from_pretrained / set_draft_vocab
            self.register_buffer("draft_vocab", torch.zeros(int(config.draft_vocab_size), dtype=torch.long))
        self.gradient_checkpointing = False
        self.post_init()

    # ---- weights ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, Qwen3RMSNorm):
            init.ones_(module.weight)
        else:
            super()._init_weights(module)  # rotary buffers

    def get_input_embeddings(self) -> None:  # the head uses the target's embedding
        return None

    def get_output_embeddings(self) -> None:  # ... and the target's lm_head
        return None

    # ---- conveniences -----------------------------------------------------------------------------
    @property
    def mask_token_id(self) -> int | None:
        return self.config.mask_token_id

    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def make_block(self, anchor_ids: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
        """`[B]` anchors -> `[B, block_size]` `[anchor, MASK, ...]` with this head's mask token."""
        return make_block(anchor_ids, block_size or self.block_size, self.mask_token_id)

    block_ids = make_block

    def new_cache(self) -> HeadCache:
        return HeadCache(self.config.num_hidden_layers)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """Raw target taps `[..., n*Ht]` -> fused context `[..., H]` (`hidden_norm(fc(taps))`)."""
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def match_dtype(self, dtype: torch.dtype) -> DraftHead:
        """Run in the target's `dtype` (in place; returns self).

        The head feeds the target's lm_head and reads its taps, so both sides compute in one dtype; a
        head *stored* in bfloat16 (half the size, e.g. the shipped SmolLM2 head) is cast on load by every
        runtime that pairs it with a float32 target."""
        param = next(self.parameters(), None)
        if param is not None and param.dtype != dtype:
            self.to(dtype=dtype)
        return self

    def check_compatible(self, target_config: Any) -> None:
        """Raise one ValueError (naming every offending field) if this head cannot run on `target_config`."""
        cfg = self.config
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        problems: list[str] = []
        t_hidden = int(tc.hidden_size)
        t_layers = int(tc.num_hidden_layers)
        t_vocab = int(tc.vocab_size)
        if cfg.target_hidden_size != t_hidden:
            problems.append(
                f"target_hidden_size: head dflash_config.target_hidden_size={cfg.target_hidden_size} "
                f"!= target hidden_size={t_hidden}"
            )
        if cfg.hidden_size != t_hidden:
            problems.append(
                f"hidden_size: head hidden_size={cfg.hidden_size} != target hidden_size={t_hidden} "
                "(the head consumes the target's token embeddings and feeds its lm_head)"
            )
        if cfg.vocab_size != t_vocab:
            problems.append(f"vocab_size: head vocab_size={cfg.vocab_size} != target vocab_size={t_vocab}")
        if cfg.num_target_layers is not None and int(cfg.num_target_layers) != t_layers:
            problems.append(
                f"num_target_layers: head num_target_layers={cfg.num_target_layers} "
                f"!= target num_hidden_layers={t_layers}"
            )
        bad = [i for i in cfg.target_layer_ids if not 0 <= i < t_layers]
        if bad or not cfg.target_layer_ids:
            problems.append(
                f"target_layer_ids: {cfg.target_layer_ids} must be non-empty and within [0, {t_layers - 1}] "
                f"(target num_hidden_layers={t_layers}); out of range: {bad}"
            )
        mask_id = cfg.mask_token_id
        if mask_id is None or not 0 <= int(mask_id) < t_vocab:
            problems.append(f"mask_token_id: {mask_id} is not a token id in [0, {t_vocab - 1}]")
        else:
            eos = (
                tc.eos_token_id
                if isinstance(getattr(tc, "eos_token_id", None), list)
                else [getattr(tc, "eos_token_id", None)]
            )
            specials = {"pad_token_id": [getattr(tc, "pad_token_id", None)], "eos_token_id": eos}
            for name, ids in specials.items():
                if int(mask_id) in [i for i in ids if i is not None]:
                    problems.append(f"mask_token_id: {mask_id} equals the target's {name}; use a reserved id")
        if problems:
            raise ValueError("draft head does not fit the target:\n  " + "\n  ".join(problems))

    # ---- masks ------------------------------------------------------------------------------------
    def _in_block_mask(self, in_block: InBlock, B: int, Q: int, device: torch.device) -> torch.Tensor:
        if in_block is None:
            in_block = "causal" if self.config.causal_head else "bidirectional"
        if isinstance(in_block, str):
            if in_block == "causal":
                m = torch.ones(Q, Q, dtype=torch.bool, device=device).tril()
            elif in_block == "bidirectional":
                m = torch.ones(Q, Q, dtype=torch.bool, device=device)
            else:
                raise ValueError(
                    f"in_block must be one of {IN_BLOCK_MODES} or a bool ancestor mask, got {in_block!r}"
                )
            return m.expand(B, Q, Q)
        m = torch.as_tensor(in_block, device=device)
        if m.dtype != torch.bool:
            raise ValueError(f"in_block ancestor mask must be a bool tensor, got {m.dtype}")
        if m.dim() == 2:
            m = m.unsqueeze(0)
        if m.dim() != 3 or m.shape[-2:] != (Q, Q) or m.shape[0] not in (1, B):
            raise ValueError(
                f"in_block ancestor mask must be [Q, Q] or [B, Q, Q] with Q={Q}, got {tuple(m.shape)}"
            )
        # a row always sees itself (ancestor-or-self convention)
        return (m | torch.eye(Q, dtype=torch.bool, device=device)).expand(B, Q, Q)

    def build_mask(self, B: int, Q: int, Kc: int, in_block: InBlock, device: torch.device) -> torch.Tensor:
        """`[B, Q, Kc+Q]` bool: every context row visible, block rows under `in_block`."""
        blk = self._in_block_mask(in_block, B, Q, device)
        ctx = torch.ones(B, Q, Kc, dtype=torch.bool, device=device)
        return torch.cat([ctx, blk], dim=-1)

    # ---- forward ----------------------------------------------------------------------------------
    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        cache: HeadCache | None = None,
        in_block: InBlock = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Draft hidden states for a block (or packed blocks / tree rows).

        Args:
            block_embeds: `[B, Q, H]` target embeddings of the block tokens (`[anchor, MASK, ...]`).
            block_positions: `[B, Q]` (or `[Q]`) absolute positions of the block rows.
            context: `[B, T, n*Ht]` NEW raw target taps (fused here); `None` = no new context rows.
            context_positions: `[B, T]` (or `[T]`) positions of the new context rows; default
                `cache.length + arange(T)` (or `arange(T)` without a cache).
            cache: if given, the new context K/V are appended per layer and attention sees the whole cache.
            in_block: `"causal"`, `"bidirectional"`, or a bool ancestor mask `[Q, Q]` / `[B, Q, Q]`
                (tree-causal; the diagonal is always allowed). `None` = the config default
                (`causal` if `dflash_config.causal_head` else `bidirectional`). Ignored if `attn_mask` is set.
            attn_mask: full bool mask `[B, Q, Kc+Q]` (or `[Q, Kc+Q]`), True = may attend, over (all visible
                context rows, i.e. cache contents after the append, then block rows). Rows with no visible
                key return the attention output 0 (no NaN) on torch >= 2.5.

        Returns:
            `[B, Q, H]` final-normed hidden states (apply the target's lm_head for logits).
        """
        if block_embeds.dim() != 3:
            raise ValueError(f"block_embeds must be [B, Q, H], got {tuple(block_embeds.shape)}")
        dtype = self.fc.weight.dtype
        device = block_embeds.device
        x = block_embeds.to(dtype)
        B, Q, _ = x.shape
        block_positions = torch.as_tensor(block_positions, device=device)
        if block_positions.dim() == 1:
            block_positions = block_positions.unsqueeze(0)
        block_positions = block_positions.expand(B, Q)

        past = cache.length if cache is not None else 0
        c = ctx_pos_emb = None
        t_new = 0
        if context is not None:
            if context.dim() != 3 or context.shape[0] != B:
                raise ValueError(f"context must be [B={B}, T, n*Ht], got {tuple(context.shape)}")
            t_new = context.shape[1]
            c = self.fuse(context)
            if context_positions is None:
                context_positions = torch.arange(past, past + t_new, device=device)
            context_positions = torch.as_tensor(context_positions, device=device)
            if context_positions.dim() == 1:
                context_positions = context_positions.unsqueeze(0)
            context_positions = context_positions.expand(B, t_new)
            ctx_pos_emb = self.rotary_emb(c, context_positions)
        elif context_positions is not None:
            raise ValueError("context_positions given without context")
        if cache is not None and past and cache.keys[-1].shape[0] != B:
            raise ValueError(f"cache batch {cache.keys[-1].shape[0]} != block batch {B}")
        kc = past + t_new

        if attn_mask is None:
            mask = self.build_mask(B, Q, kc, in_block, device)
        else:
            mask = torch.as_tensor(attn_mask, device=device)
            if mask.dtype != torch.bool:
                raise ValueError(f"attn_mask must be a bool tensor, got {mask.dtype}")
            if mask.dim() == 2:
                mask = mask.unsqueeze(0)
            if mask.dim() != 3 or mask.shape[-2:] != (Q, kc + Q) or mask.shape[0] not in (1, B):
                raise ValueError(
                    f"attn_mask must be [B, Q, Kc+Q] = [{B}, {Q}, {kc + Q}] (Kc = visible context rows), "
                    f"got {tuple(mask.shape)}"
                )
            mask = mask.expand(B, Q, kc + Q)
        mask = mask.unsqueeze(1)  # [B, 1, Q, K], broadcast over heads

        pos_emb = self.rotary_emb(x, block_positions)
        use_ckpt = self.gradient_checkpointing and self.training and cache is None and torch.is_grad_enabled()
        for layer in self.layers:
            if use_ckpt:
                x = self._gradient_checkpointing_func(layer.__call__, x, pos_emb, mask, c, ctx_pos_emb, None)
            else:
                x = layer(x, pos_emb, mask, c, ctx_pos_emb, cache)
        return self.norm(x)
