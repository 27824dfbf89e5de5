"""`jetflow::TreeAttention` in ONNX: its schema and the exporter's translation of the torch custom op.

The schema is registered with `onnx.defs` so that onnxscript can emit the node, `onnx.checker` can check
it (full check, with shape inference: the output has the query's type and shape), and readers of a graph
see the documented contract. TensorRT's ONNX parser maps the node to the plugin named `TreeAttention`
(version `plugin_version`, namespace `plugin_namespace`); the domain is not used for that lookup.
"""

from __future__ import annotations

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema

from jetflow_pl.runtime.contract import (
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    TREE_ATTENTION_DOMAIN,
    TREE_ATTENTION_OP,
)

_DOC = (
    "Tree-causal attention (see jetflow_pl/ops/tree_attention.py). query [B,Hq,N,d]; past_key/past_value "
    "[B,Hkv,P,d]: rows [0, past_lengths[b]) visible from every row of request b (all P rows without "
    "past_lengths); key/value [B,Hkv,N,d] visible where bit j of packed_mask[b, i] is set (int32 "
    "[N, ceil(N/32)] shared by the batch or [B, N, ceil(N/32)] per request, LSB first); optional "
    "past_lengths int32 [B]; a row that sees nothing is 0; output [B,Hq,N,d]. window > 0 (a sliding-window "
    "layer): row i, at position past_len + depth(i) with depth(i) = popcount(mask row i) - 1, also loses every "
    "key whose position k has pos(i) - k >= window (prefix row p at position p, tree row t at past_len + "
    "depth(t))."
)


def _schema() -> OpSchema:
    param = OpSchema.FormalParameter
    attr = OpSchema.Attribute
    return OpSchema(
        TREE_ATTENTION_OP,
        TREE_ATTENTION_DOMAIN,
        1,
        doc=_DOC,
        inputs=[
            param("query", "T"),
            param("past_key", "T"),
            param("past_value", "T"),
            param("key", "T"),
            param("value", "T"),
            param("packed_mask", "tensor(int32)"),
            param("past_lengths", "tensor(int32)", param_option=OpSchema.FormalParameterOption.Optional),
        ],
        outputs=[param("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types")],
        attributes=[
            attr("scale", OpSchema.AttrType.FLOAT, "softmax scale"),
            attr("num_heads", OpSchema.AttrType.INT, "query heads Hq"),
            attr("num_kv_heads", OpSchema.AttrType.INT, "key/value heads Hkv (GQA when < Hq)"),
            attr("head_size", OpSchema.AttrType.INT, "head dimension d"),
            attr("window", OpSchema.AttrType.INT, "sliding window (0: none)", required=False),
            attr("plugin_version", OpSchema.AttrType.STRING, "TensorRT plugin version"),
            attr("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace"),
        ],
    )


def register_schema() -> None:
    """Register the TreeAttention schema once per process (idempotent)."""
    if onnx.defs.has(TREE_ATTENTION_OP, TREE_ATTENTION_DOMAIN):
        return
    onnx.defs.register_schema(_schema())


register_schema()
_JETFLOW = onnxscript.values.Opset(TREE_ATTENTION_DOMAIN, 1)
_TREE_ATTENTION = onnxscript.values.Op(_JETFLOW, TREE_ATTENTION_OP)


def tree_attention_to_onnx(
    query, past_key, past_value, key, value, packed_mask, scale: float, past_lengths=None, window: int = 0
):
    """Translation of `jetflow::tree_attention` (torch.onnx dynamo exporter): one TreeAttention node, with
    6 inputs (batch-1 form: every prefix row visible) or 7 (`past_lengths` per request). The `window`
    attribute is written only on sliding-window layers, so graphs of full-attention models are unchanged."""
    inputs = [query, past_key, past_value, key, value, packed_mask]
    if past_lengths is not None:
        inputs.append(past_lengths)
    extra = {"window": int(window)} if window else {}
    return _TREE_ATTENTION(
        *inputs,
        **extra,
        scale=float(scale),
        num_heads=int(query.shape[1]),
        num_kv_heads=int(key.shape[1]),
        head_size=int(query.shape[3]),
        plugin_version=PLUGIN_VERSION,
        plugin_namespace=PLUGIN_NAMESPACE,
    )


def masked_attention_to_onnx(query, keys, values, visible, scale: float):
    """Translation of `jetflow::masked_attention`: one opset-23 `Attention` node (GQA from the 4-D
    shapes, boolean mask `[N, P+N]` broadcast over batch and heads, or `[B, 1, N, P+N]` per request)."""
    from onnxscript import opset23

    outputs = opset23.Attention(query, keys, values, visible, scale=float(scale))
    return outputs[0] if isinstance(outputs, tuple | list) else outputs


def translation_table() -> dict:
    """`custom_translation_table` for `torch.onnx.export(..., dynamo=True)`."""
    import jetflow_pl.ops  # noqa: F401  (registers the torch ops)

    return {
        torch.ops.jetflow.tree_attention.default: tree_attention_to_onnx,
        torch.ops.jetflow.masked_attention.default: masked_attention_to_onnx,
    }
