"""Torch binding of the TensorRT `TreeAttention` plugin's CUDA kernel, compiled on first use.

The extension links the same `tree_attention_kernel.cu` the plugin enqueues, so a GPU machine without
TensorRT can check the plugin's numerics against `jetflow_pl.ops.tree_attention_reference`. It is built
with `torch.utils.cpp_extension.load` (nvcc + ninja, cached under TORCH_EXTENSIONS_DIR) and only when CUDA
is available: on a CPU-only torch there is nothing to launch the kernel on.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

EXTENSION_NAME = "jetflow_tree_attention_ext"
_HERE = Path(__file__).resolve().parent
_KERNEL_DIR = _HERE.parent  # tree_attention_kernel.cu / .cuh
SOURCES = (_HERE / "tree_attention_ext.cpp", _KERNEL_DIR / "tree_attention_kernel.cu")

_module: ModuleType | None = None


def load_extension(verbose: bool = False) -> ModuleType:
    """Compile (once per process; nvcc output is cached on disk) and import the extension."""
    global _module
    if _module is not None:
        return _module
    if not torch.cuda.is_available():
        raise RuntimeError("the tree-attention CUDA extension needs torch with CUDA and a visible GPU")
    from torch.utils.cpp_extension import load

    _module = load(
        name=EXTENSION_NAME,
        sources=[str(path) for path in SOURCES],
        extra_include_paths=[str(_KERNEL_DIR)],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17"],
        verbose=verbose,
    )
    return _module


def tree_attention_cuda(
    query: Tensor,
    past_key: Tensor,
    past_value: Tensor,
    key: Tensor,
    value: Tensor,
    packed_mask: Tensor,
    scale: float,
    past_lengths: Tensor | None = None,
) -> Tensor:
    """The `jetflow::tree_attention` contract (see `jetflow_pl/ops/tree_attention.py`) on the CUDA kernel.

    All tensors on one CUDA device; query/keys/values share one dtype (float32, float16 or bfloat16),
    head size 64 or 128, packed_mask int32 `[N, ceil(N/32)]` (shared) or `[B, N, ceil(N/32)]` (per
    request), past_lengths int32 `[B]` or None. Returns `[B, Hq, N, d]` in the query's dtype.
    """
    return load_extension().tree_attention_cuda(
        query, past_key, past_value, key, value, packed_mask, float(scale), past_lengths
    )
