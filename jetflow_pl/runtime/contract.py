"""The engine-directory contract: file names, graph input/output names and dynamic axes, the TreeAttention
node, and where the TensorRT plugin library is looked for.

Every consumer (the exporter in `export/`, the ONNX Runtime and TensorRT backends, the engine builder, the
tests) reads names from here, so a rename is one edit; the runtime owns it because an engine directory is
what the runtime loads (the exporter writes to it). Shapes use these symbols:

    T  new context rows handed to the head          Q  draft-block (or refinement) rows
    P  rows already in a KV cache (may be 0)         N  tree nodes in a verify step
    Wq = ceil(Q / 32), W = ceil(N / 32)              packed-mask words
    L / Lh  target / head layers    Hkv / d  KV heads / head size    F = n_taps * target hidden size
    K  top-k kept per draft row     V  vocabulary
    B  requests in one forward (the batched graphs only)
The batch-1 graphs (`HEAD_INPUTS` ...) have a static batch axis of 1: one sequence per graph call, what
the TensorRT engines are built from. The batched graphs (`BATCHED_HEAD_INPUTS` ..., engine config
`"batched": true`, written by `jetflow-export --max-batch N` with N > 1) have a dynamic batch axis `B` and
per-request KV lengths: request `b`'s committed rows are `[0, past_lengths[b])` of the padded `P`, its
tree is `tree_mask[b]` (TensorRT-LLM's `[B, N, ceil(N/32)]` packed layout, rows past its generation length
all zero) and its positions `past_lengths[b] + depth` (the position offsets); the head graph's new
context rows of request `b` are `[0, context_lengths[b])` of `T`. `graph_io(role, batched)` picks one.

`config.json` of an engine directory (written by the exporter, read by every runtime backend through
`engine_config.load_engine_config`):

    format: "jetflow-engine", format_version: 1, variant: "plugin" | "portable" | "attention", opset: int,
    graphs: {"head": {"file", "inputs": [names], "outputs": [names]}, "target": {...}},
    block_size, mask_token_id, causal_head, topk, vocab_size, max_positions, eos_token_id, target_layer_ids,
    target: {model_type, num_layers, num_heads, num_kv_heads, head_dim, hidden_size},
    head:   {num_layers, num_heads, num_kv_heads, head_dim, hidden_size, tap_features},
    batched: bool (absent: false), max_batch: int (the slots a runtime opens by default; 1 when not batched),
    tokenizer: "tokenizer" (a folder), engines: {"head": file, "target": file} once TensorRT engines exist,
    plus "tensorrt": {profile limits, precision, plugin_library, version} written by `jetflow-export --engine`.
"""

from __future__ import annotations

import os
from pathlib import Path

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

# the batched graphs: the same computation over B requests, each with its own KV length (see above)
BATCHED_HEAD_INPUTS = {
    "context_taps": ("float", ["B", "T", "F"]),
    "context_positions": ("int64", ["B", "T"]),
    "context_lengths": ("int32", ["B"]),
    "block_ids": ("int64", ["B", "Q"]),
    "block_positions": ("int64", ["B", "Q"]),
    "block_mask": ("int32", ["Q", "Wq"]),
    "past_lengths": ("int32", ["B"]),
    "past_keys": ("float", ["Lh", "B", "Hkv", "P", "d"]),
    "past_values": ("float", ["Lh", "B", "Hkv", "P", "d"]),
}
BATCHED_HEAD_OUTPUTS = {
    "topk_logprobs": ("float", ["B", "Q", "K"]),
    "topk_ids": ("int64", ["B", "Q", "K"]),
    "present_keys": ("float", ["Lh", "B", "Hkv", "P+T", "d"]),
    "present_values": ("float", ["Lh", "B", "Hkv", "P+T", "d"]),
}
BATCHED_TARGET_INPUTS = {
    "input_ids": ("int64", ["B", "N"]),
    "position_ids": ("int64", ["B", "N"]),
    "tree_mask": ("int32", ["B", "N", "W"]),
    "past_lengths": ("int32", ["B"]),
    "past_keys": ("float", ["L", "B", "Hkv", "P", "d"]),
    "past_values": ("float", ["L", "B", "Hkv", "P", "d"]),
}
BATCHED_TARGET_OUTPUTS = {
    "logits": ("float", ["B", "N", "V"]),
    "argmax_ids": ("int64", ["B", "N"]),
    "taps": ("float", ["B", "N", "F"]),
    "present_keys": ("float", ["L", "B", "Hkv", "P+N", "d"]),
    "present_values": ("float", ["L", "B", "Hkv", "P+N", "d"]),
}


_DYNAMIC = ("B", "T", "Q", "Wq", "N", "W", "P")


def _dynamic_axes(inputs: dict[str, tuple[str, list]]) -> dict[str, dict[int, str]]:
    return {
        name: {axis: sym for axis, sym in enumerate(shape) if isinstance(sym, str) and sym in _DYNAMIC}
        for name, (_, shape) in inputs.items()
        if any(isinstance(sym, str) and sym in _DYNAMIC for sym in shape)
    }


BATCHED_DYNAMIC_AXES = {
    "head": _dynamic_axes(BATCHED_HEAD_INPUTS),
    "target": _dynamic_axes(BATCHED_TARGET_INPUTS),
}


def graph_io(role: str, batched: bool = False) -> tuple[dict, dict, dict[str, dict[int, str]]]:
    """(inputs, outputs, dynamic axes) of the `role` ("head" / "target") graph, batch-1 or batched."""
    if role not in ("head", "target"):
        raise ValueError(f"unknown graph role {role!r}: expected 'head' or 'target'")
    if batched:
        if role == "head":
            return BATCHED_HEAD_INPUTS, BATCHED_HEAD_OUTPUTS, BATCHED_DYNAMIC_AXES["head"]
        return BATCHED_TARGET_INPUTS, BATCHED_TARGET_OUTPUTS, BATCHED_DYNAMIC_AXES["target"]
    if role == "head":
        return HEAD_INPUTS, HEAD_OUTPUTS, DYNAMIC_AXES["head"]
    return TARGET_INPUTS, TARGET_OUTPUTS, DYNAMIC_AXES["target"]


#: where `trt_plugins/README.md`'s CMake commands put the plugin library (relative to the repository root)
DEFAULT_PLUGIN_LIB = Path("build") / "trt_plugins" / "libjetflow_trt_plugins.so"
#: environment variable that overrides the default plugin library location
PLUGIN_LIB_ENV = "JETFLOW_TRT_PLUGIN_LIB"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def default_plugin_lib() -> Path:
    """The plugin library used when none is given: `$JETFLOW_TRT_PLUGIN_LIB`, else the README's build path.

    The engine builder loads it before parsing a `plugin` graph and the TensorRT backend before
    deserializing a `plugin` engine (an engine names its plugin, it does not contain its code)."""
    env = os.environ.get(PLUGIN_LIB_ENV)
    return Path(env) if env else _REPO_ROOT / DEFAULT_PLUGIN_LIB
