"""The decode runtime: the engine directory end to end, and the compute behind the decode loop.

    engine dir  --(contract.py: file/graph/tensor names; engine_config.py: config.json)-->
    load_backend(kind)  ->  torch | torch-graph | onnxruntime | tensorrt backend
                        ->  SequenceBackend (sequence.py: the one KV/tap bookkeeping)
                        ->  KVStore (kv_store.py: HF cache / tensors / preallocated buffers)

The decode loop (`jetflow_pl.decoding`: tree, acceptance, budget) talks to a backend only through the
`DecodeBackend` protocol (`backend.py`); this package imports nothing from it. Names are resolved lazily,
so `from jetflow_pl.runtime.contract import ...` (the exporter) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "BACKEND_KINDS": "jetflow_pl.runtime.loader",
    "load_backend": "jetflow_pl.runtime.loader",
    "DecodeBackend": "jetflow_pl.runtime.backend",
    "SequenceBackend": "jetflow_pl.runtime.sequence",
}

__all__ = ["BACKEND_KINDS", "DecodeBackend", "SequenceBackend", "load_backend"]

if TYPE_CHECKING:
    from jetflow_pl.runtime.backend import DecodeBackend
    from jetflow_pl.runtime.loader import BACKEND_KINDS, load_backend
    from jetflow_pl.runtime.sequence import SequenceBackend


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jetflow_pl.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
