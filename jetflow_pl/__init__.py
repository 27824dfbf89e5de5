"""jetflow_pl: causal parallel draft heads (JetFlow) for lossless speculative decoding.

Stages: `data_gen` (regenerate data with the target) -> `jetflow_pl` (draft head, tree, distillation,
decode loop) -> `export` (ONNX / TensorRT) -> `trt_plugins` (the TreeAttention plugin). The library
imports none of the stages.

The main classes are importable from the top level (`from jetflow_pl import TargetModel, DraftHead,
SpeculativeGenerator`), but lazily (PEP 562 `__getattr__`): importing the package loads neither torch
nor transformers, so `python -m jetflow_pl --help` starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it (imported on first access)
_LAZY = {
    "TargetModel": "jetflow_pl.target",
    "DraftHead": "jetflow_pl.head",
    "DraftHeadConfig": "jetflow_pl.head",
    "SpeculativeGenerator": "jetflow_pl.decoding.generator",
    "ARGenerator": "jetflow_pl.decoding.generator",
    "GenerationResult": "jetflow_pl.decoding.generator",
    "SamplingConfig": "jetflow_pl.decoding.sampling",
    "TorchBackend": "jetflow_pl.runtime.torch_backend",
    "AutoBudget": "jetflow_pl.decoding.budget",
    "FixedBudget": "jetflow_pl.decoding.budget",
    "load_draft_head": "jetflow_pl.checkpoints",
    "UserInputError": "jetflow_pl.errors",
}

__all__ = [
    "ARGenerator",
    "AutoBudget",
    "DraftHead",
    "DraftHeadConfig",
    "FixedBudget",
    "GenerationResult",
    "SamplingConfig",
    "SpeculativeGenerator",
    "TargetModel",
    "TorchBackend",
    "UserInputError",
    "__version__",
    "load_draft_head",
]

if TYPE_CHECKING:  # for type checkers and IDEs only; at runtime the names resolve lazily
    from jetflow_pl.checkpoints import load_draft_head
    from jetflow_pl.decoding.budget import AutoBudget, FixedBudget
    from jetflow_pl.decoding.generator import ARGenerator, GenerationResult, SpeculativeGenerator
    from jetflow_pl.decoding.sampling import SamplingConfig
    from jetflow_pl.errors import UserInputError
    from jetflow_pl.head import DraftHead, DraftHeadConfig
    from jetflow_pl.runtime.torch_backend import TorchBackend
    from jetflow_pl.target import TargetModel


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jetflow_pl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
