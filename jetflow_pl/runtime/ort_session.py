"""ONNX Runtime sessions for exported graphs, including the `plugin` variant's TreeAttention nodes.

`plugin` graphs carry `jetflow::TreeAttention` nodes (meant for the TensorRT plugin). On plain ONNX
Runtime they run through an onnxruntime-extensions Python custom op that computes the reference
implementation. onnxruntime-extensions only serves Python ops in the domain `ai.onnx.contrib`, and a
Python op has a fixed arity, so the loader rewrites the nodes in memory before building the session: the
domain, and for the batched node (7 inputs: `past_lengths` last) the op type of its own Python op. The
file on disk is untouched.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

from jetflow_pl.runtime.contract import TREE_ATTENTION_DOMAIN, TREE_ATTENTION_OP

#: the only domain onnxruntime-extensions accepts for Python custom ops
PYOP_DOMAIN = "ai.onnx.contrib"
#: the Python op serving the 7-input node (per-request KV lengths)
PYOP_WITH_LENGTHS = TREE_ATTENTION_OP + "WithLengths"
_PYOP_REGISTERED = False


def _register_tree_attention_pyop() -> None:
    """Register the TreeAttention Python op with onnxruntime-extensions (once per process)."""
    global _PYOP_REGISTERED
    if _PYOP_REGISTERED:
        return
    try:
        from onnxruntime_extensions import PyCustomOpDef, onnx_op
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "running a 'plugin' engine on ONNX Runtime needs onnxruntime-extensions "
            "(pip install 'jetflow-pl[export]'), or export the 'portable' variant instead"
        ) from err

    from jetflow_pl.ops import tree_attention_reference

    dt = PyCustomOpDef
    attrs = {
        "scale": dt.dt_float,
        "num_heads": dt.dt_int64,
        "num_kv_heads": dt.dt_int64,
        "head_size": dt.dt_int64,
        "window": dt.dt_int64,
        "plugin_version": dt.dt_string,
        "plugin_namespace": dt.dt_string,
    }

    def run(arrays, scale: float, past_lengths=None, window: int = 0):
        tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays[:5]]
        mask = torch.from_numpy(np.ascontiguousarray(arrays[5], dtype=np.int32))
        lengths = None
        if past_lengths is not None:
            lengths = torch.from_numpy(np.ascontiguousarray(past_lengths, dtype=np.int32))
        with torch.no_grad():
            return tree_attention_reference(*tensors, mask, float(scale), lengths, int(window)).numpy()

    inputs = [dt.dt_float] * 5 + [dt.dt_int32]

    @onnx_op(op_type=TREE_ATTENTION_OP, domain=PYOP_DOMAIN, inputs=inputs, outputs=[dt.dt_float], attrs=attrs)
    def tree_attention_pyop(query, past_key, past_value, key, value, packed_mask, **kw):
        return run((query, past_key, past_value, key, value, packed_mask), kw["scale"], None, kw["window"])

    @onnx_op(
        op_type=PYOP_WITH_LENGTHS,
        domain=PYOP_DOMAIN,
        inputs=[*inputs, dt.dt_int32],
        outputs=[dt.dt_float],
        attrs=attrs,
    )
    def tree_attention_lengths_pyop(query, past_key, past_value, key, value, packed_mask, past_lengths, **kw):
        return run(
            (query, past_key, past_value, key, value, packed_mask), kw["scale"], past_lengths, kw["window"]
        )

    _PYOP_REGISTERED = True


def uses_tree_attention_nodes(model: onnx.ModelProto) -> bool:
    return any(n.domain == TREE_ATTENTION_DOMAIN for n in model.graph.node)


def _retarget_domain(model: onnx.ModelProto) -> onnx.ModelProto:
    """Move `jetflow` nodes (and the opset import) into onnxruntime-extensions' domain, in memory; a node
    without the optional `window` attribute (a global layer) gets `window=0`, which the Python op reads."""
    for node in model.graph.node:
        if node.domain == TREE_ATTENTION_DOMAIN:
            node.domain = PYOP_DOMAIN
            if not any(a.name == "window" for a in node.attribute):
                node.attribute.append(onnx.helper.make_attribute("window", 0))
            if len(node.input) == 7:
                node.op_type = PYOP_WITH_LENGTHS
    imports = [o for o in model.opset_import if o.domain != TREE_ATTENTION_DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(imports)
    if not any(o.domain == PYOP_DOMAIN for o in imports):
        model.opset_import.append(onnx.helper.make_opsetid(PYOP_DOMAIN, 1))
    return model


def make_session(path: str | Path, intra_op_threads: int | None = None):
    """An ONNX Runtime CPU session for an exported graph (either variant)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ONNX graph not found: {path}")
    return session_from_model(onnx.load(str(path)), intra_op_threads)


def session_from_model(model: onnx.ModelProto, intra_op_threads: int | None = None):
    """An ONNX Runtime CPU session for a graph in memory (`model` is rewritten in place when it carries
    TreeAttention nodes)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if intra_op_threads is not None:
        options.intra_op_num_threads = int(intra_op_threads)
    if uses_tree_attention_nodes(model):
        _register_tree_attention_pyop()
        from onnxruntime_extensions import get_library_path

        options.register_custom_ops_library(get_library_path())
        model = _retarget_domain(model)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
