"""`load_backend(kind, ...)`: one way for every command line and script to pick a decode backend.

Kinds (`BACKEND_KINDS`):

* `torch`: `TorchBackend`, the HF target (+ head) eagerly on any torch device;
* `torch-graph`: `TorchGraphBackend`, the decode graphs eagerly in torch (the exported graphs' reference;
  on CUDA the tree attention is the Triton kernel); `graph` is accepted as its older name;
* `onnxruntime`: `OnnxRuntimeBackend` over an engine directory's ONNX graphs (CPU);
* `tensorrt`: `TensorRTBackend` over an engine directory's TensorRT engines (one CUDA GPU).

The torch kinds take the models (objects, or folders to load them from); the engine kinds take the
engine directory, which holds everything they need (`config.json`). Bad input is one `UserInputError`
(a missing folder, an engine directory that is not one, TensorRT absent): the command lines print it as
one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jetflow_pl.errors import MissingPathError, UserInputError
from jetflow_pl.runtime.backend import DecodeBackend

BACKEND_KINDS = ("torch", "torch-graph", "onnxruntime", "tensorrt")
ENGINE_KINDS = ("onnxruntime", "tensorrt")
_ALIASES = {"graph": "torch-graph"}

__all__ = ["BACKEND_KINDS", "ENGINE_KINDS", "load_backend", "resolve_kind"]


def resolve_kind(kind: str) -> str:
    """The canonical kind name (`graph` -> `torch-graph`); one error naming the kinds otherwise."""
    kind = _ALIASES.get(kind, kind)
    if kind not in BACKEND_KINDS:
        raise UserInputError(f"unknown backend {kind!r}: expected one of {', '.join(BACKEND_KINDS)}")
    return kind


def _head(head: Any):
    if head is None or not isinstance(head, (str, Path)):
        return head
    from jetflow_pl.checkpoints import load_draft_head

    return load_draft_head(head)


def _target(target: Any, head: Any, device: str | None):
    if not isinstance(target, (str, Path)):
        return target
    from jetflow_pl.target import TargetModel

    if not Path(target).is_dir():
        raise MissingPathError(f"target directory {target} does not exist")
    taps = tuple(head.config.target_layer_ids) if head is not None else ()
    return TargetModel.from_pretrained(target, taps, device=device or "cpu")


def load_backend(
    kind: str,
    *,
    target: Any = None,
    head: Any = None,
    engine_dir: str | Path | None = None,
    device: str | None = None,
    topk: int = 8,
    intra_op_threads: int | None = None,
    plugin_lib: str | Path | None = None,
) -> DecodeBackend:
    """A decode backend of `kind` (see the module docstring).

    torch / torch-graph: `target` (a `TargetModel` or its folder) and `head` (a `DraftHead`, its folder,
    or None for the torch kind: an AR-only backend); `device` places models loaded from folders; `topk`:
    what the torch-graph head keeps per depth (bounds the tree width). onnxruntime: `engine_dir`,
    `intra_op_threads`. tensorrt: `engine_dir`, `device` (default `cuda`), `plugin_lib`.
    """
    kind = resolve_kind(kind)
    if kind in ENGINE_KINDS:
        if engine_dir is None:
            raise UserInputError(f"backend {kind!r} needs an engine directory (written by jetflow-export)")
        try:
            if kind == "onnxruntime":
                from jetflow_pl.runtime.ort_backend import OnnxRuntimeBackend

                return OnnxRuntimeBackend(engine_dir, intra_op_threads=intra_op_threads)
            from jetflow_pl.runtime.tensorrt_backend import TensorRTBackend

            return TensorRTBackend(engine_dir, device=device or "cuda", plugin_lib=plugin_lib)
        except FileNotFoundError as err:
            raise MissingPathError(str(err)) from err
        except (ValueError, ImportError, RuntimeError) as err:
            raise UserInputError(str(err)) from err
    if target is None:
        raise UserInputError(f"backend {kind!r} needs the target model (target=...)")
    head = _head(head)
    target = _target(target, head, device)
    if kind == "torch":
        from jetflow_pl.runtime.torch_backend import TorchBackend

        return TorchBackend(target, head)
    if head is None:
        raise UserInputError("backend 'torch-graph' needs a draft head (head=...): its graphs include it")
    from jetflow_pl.runtime.graph_backend import TorchGraphBackend

    return TorchGraphBackend(target, head, topk=topk)
