"""The graph contract: file names, input/output names and dynamic axes of the exported graphs.

Every consumer (the exporter, the ONNX Runtime backend, the TensorRT engine builder and backend, the
tests) reads names from here, so a rename is one edit. Shapes use these symbols:

    T  new context rows handed to the head          Q  draft-block (or refinement) rows
    P  rows already in a KV cache (may be 0)         N  tree nodes in a verify step
    Wq = ceil(Q / 32), W = ceil(N / 32)              packed-mask words
    L / Lh  target / head layers    Hkv / d  KV heads / head size    F = n_taps * target hidden size
    K  top-k kept per draft row     V  vocabulary
The batch axis is static 1 (one sequence per decode loop).

`config.json` of an engine directory (written by the exporter, read by every runtime backend):

    format: "jetflow-engine", format_version: 1, variant: "plugin" | "portable", opset: int,
    graphs: {"head": {"file", "inputs": [names], "outputs": [names]}, "target": {...}},
    block_size, mask_token_id, topk, vocab_size, max_positions, eos_token_id, target_layer_ids,
    target: {num_layers, num_heads, num_kv_heads, head_dim, hidden_size},
    head:   {num_layers, num_heads, num_kv_heads, head_dim, hidden_size, tap_features},
    tokenizer: "tokenizer" (a folder), engines: {"head": file, "target": file} once TensorRT engines exist,
    plus "tensorrt": {profile limits, precision} written by `jetflow-export --engine`.
"""

from __future__ import annotations

HEAD_GRAPH = "draft_head.onnx"
TARGET_GRAPH = "target_verify.onnx"
CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
VARIANTS = ("plugin", "portable", "attention")
#: lowest ONNX opset per variant (opset-23 `Attention` for the `attention` variant)
MIN_OPSET = {"plugin": 18, "portable": 18, "attention": 23}

#: TreeAttention node: domain and fixed attributes (TensorRT's parser looks plugins up by op_type).
TREE_ATTENTION_OP = "TreeAttention"
TREE_ATTENTION_DOMAIN = "jetflow"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = ""

# draft head: new context taps + block + head KV in; per-row top-k + new head KV out
HEAD_INPUTS = {
    "context_taps": ("float", [1, "T", "F"]),
    "context_positions": ("int64", [1, "T"]),
    "block_ids": ("int64", [1, "Q"]),
    "block_positions": ("int64", [1, "Q"]),
    "block_mask": ("int32", ["Q", "Wq"]),
    "past_keys": ("float", ["Lh", 1, "Hkv", "P", "d"]),
    "past_values": ("float", ["Lh", 1, "Hkv", "P", "d"]),
}
HEAD_OUTPUTS = {
    "topk_logprobs": ("float", [1, "Q", "K"]),
    "topk_ids": ("int64", [1, "Q", "K"]),
    "present_keys": ("float", ["Lh", 1, "Hkv", "P+T", "d"]),
    "present_values": ("float", ["Lh", 1, "Hkv", "P+T", "d"]),
}

# target verify (also the prefill, with a chain mask and P = 0)
TARGET_INPUTS = {
    "input_ids": ("int64", [1, "N"]),
    "position_ids": ("int64", [1, "N"]),
    "tree_mask": ("int32", ["N", "W"]),
    "past_keys": ("float", ["L", 1, "Hkv", "P", "d"]),
    "past_values": ("float", ["L", 1, "Hkv", "P", "d"]),
}
TARGET_OUTPUTS = {
    "logits": ("float", [1, "N", "V"]),
    "argmax_ids": ("int64", [1, "N"]),
    "taps": ("float", [1, "N", "F"]),
    "present_keys": ("float", ["L", 1, "Hkv", "P+N", "d"]),
    "present_values": ("float", ["L", 1, "Hkv", "P+N", "d"]),
}

#: input name -> {axis: symbol} for the axes that must stay dynamic in every graph
DYNAMIC_AXES = {
    "head": {"context_taps": {1: "T"}, "context_positions": {1: "T"}, "block_ids": {1: "Q"},
             "block_positions": {1: "Q"}, "block_mask": {0: "Q", 1: "Wq"}, "past_keys": {3: "P"},
             "past_values": {3: "P"}},
    "target": {"input_ids": {1: "N"}, "position_ids": {1: "N"}, "tree_mask": {0: "N", 1: "W"},
               "past_keys": {3: "P"}, "past_values": {3: "P"}},
}  # fmt: skip
