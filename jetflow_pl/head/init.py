"""Initialise a draft head's decoder layers from the target's own decoder layers.

JetSpec++-style heads are described as a slice of the target's last layers: a head whose layers start
as copies of target layers `L-n .. L-1` begins with the target's own next-token machinery instead of
random weights, which matters most when training compute is small (a CPU, a short run). The head's
layers are Qwen3-style: every projection, MLP and pre-norm has a counterpart in a Llama/Qwen2/Qwen3/
Mistral target layer and is copied; the per-head q/k RMSNorms exist only in Qwen3 targets (copied then,
left at their initial ones otherwise). The head's final norm is copied from the target's final norm, so
a head initialised from the last layers feeds the target's lm_head the way the target does.

Gemma 3 layers ("sandwich" norms) map as closely as the head's layer allows: Gemma's RMSNorm scales by
`1 + w` where the head's scales by `w`, so every copied norm weight gains 1; the head's pre-MLP norm takes
Gemma's `pre_feedforward_layernorm`; Gemma's `post_attention_layernorm` / `post_feedforward_layernorm`
(applied to a sublayer's output) have no counterpart and are left out, so such a head starts near, not
at, the target's layers (training closes the gap).

The fused context (`fc`, `hidden_norm`) has a counterpart only in one case: a head with ONE tap, the
output of the target layer just below the first copied layer (`target_layer_ids == [ids[0] - 1]`). Its
context `hidden_norm(fc(x))` then becomes exactly that layer's input norm `input_layernorm(x)` with
`fc = I` and `hidden_norm.weight` = the copied layer's input-norm weight: the head's first layer sees the
context K/V the target layer computes (later head layers see the same context, an approximation). In
every other case the fusion keeps its random initialisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from jetflow_pl.errors import UserInputError
from jetflow_pl.target import has_sandwich_norms

#: head-layer parameters copied from a target layer (names under both layers)
_COPIED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
_OPTIONAL = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


#: Gemma-style layers: the head's name -> the target's (norms scale by 1 + w there)
_GEMMA_NAMES = {"post_attention_layernorm.weight": "pre_feedforward_layernorm.weight"}


@torch.no_grad()
def init_head_from_target_layers(head, target, layer_ids: Sequence[int]) -> list[str]:
    """Copy target decoder layer `layer_ids[i]` into head layer `i` (and the final norm); return the copied
    parameter names. One `UserInputError` when the counts or shapes do not fit."""
    layer_ids = [int(i) for i in layer_ids]
    if len(layer_ids) != len(head.layers):
        raise UserInputError(
            f"init_from_target_layers names {len(layer_ids)} target layers for a head of {len(head.layers)} "
            "layers: give one target layer per head layer"
        )
    bad = [i for i in layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise UserInputError(
            f"init_from_target_layers: {bad} outside the target's layers 0..{target.num_layers - 1}"
        )
    copied = []
    gemma = has_sandwich_norms(target.layers[0])
    names = _GEMMA_NAMES if gemma else {}
    norm_offset = 1.0 if gemma else 0.0  # what a target norm weight needs to scale like the head's
    for h_idx, t_idx in enumerate(layer_ids):
        h_params = dict(head.layers[h_idx].named_parameters())
        t_params = dict(target.layers[t_idx].named_parameters())
        for name in (*_COPIED, *_OPTIONAL):
            source = names.get(name, name)
            if source not in t_params:
                if name in _OPTIONAL:
                    continue
                raise UserInputError(
                    f"target layer {t_idx} has no {name}: cannot initialise the head from it"
                )
            src, dst = t_params[source], h_params[name]
            if src.shape != dst.shape:
                raise UserInputError(
                    f"init_from_target_layers: target layer {t_idx} {name} has shape {tuple(src.shape)}, the "
                    f"head's is {tuple(dst.shape)} (the head must have the target's layer shapes)"
                )
            dst.copy_(src.to(dst.dtype) + (norm_offset if "norm" in name else 0.0))
            copied.append(f"layers.{h_idx}.{name}")
    head.norm.weight.copy_(target.final_norm.weight.to(head.norm.weight.dtype) + norm_offset)
    copied.append("norm.weight")
    if (
        list(head.target_layer_ids) == [layer_ids[0] - 1]
        and head.fc.weight.shape[0] == head.fc.weight.shape[1]
    ):
        head.fc.weight.copy_(torch.eye(head.fc.weight.shape[0], dtype=head.fc.weight.dtype))
        norm = target.layers[layer_ids[0]].input_layernorm.weight
        head.hidden_norm.weight.copy_(norm.to(head.hidden_norm.weight.dtype) + norm_offset)
        copied += ["fc.weight", "hidden_norm.weight"]
    return copied
