"""The TensorRT backend: the engines of an engine directory (`jetflow-export --engine`) on one CUDA GPU.

Same protocol, bookkeeping and graph contract as `OnnxRuntimeBackend` (`SequenceBackend` /
`GraphBackend`); what is TensorRT's own is here: deserializing the engines (and loading the TreeAttention
plugin first for a `plugin` engine), binding tensors by name, and where the memory lives, following the
TensorRT-LLM runtime pattern:

* the large buffers are allocated once, at the optimization profile's maximum sizes: both KV caches as
  `BufferKVStore`s (ping-pong, `max_context + max_tree` rows; `commit` swaps or gathers into the committed
  buffer), the head's queued context as a `TapQueue` with a capacity, and every engine output (logits,
  taps, top-k); a step binds views of them (`set_tensor_address`), so TensorRT writes its outputs straight
  into them. The per-step inputs (tree ids, positions, packed mask, the block) are a few hundred bytes
  from torch's caching allocator. The engines run on the current torch CUDA stream, so torch work and
  TensorRT work are ordered without extra synchronisation; logits stay on the GPU;
* the prompt is prefilled through the verify engine in chunks of at most `max_tree` rows with a chain
  mask (the same engine profile as the decode steps, so one execution context per engine).

Limits come from the engines themselves (optimization profile 0): `max_tree_nodes` (the decode loop reads
it to bound its budget) and `max_positions` (the target's limit, capped by the profile's context size).
A tree larger than the profile is refused with a `ValueError` naming both sizes (`check_tree_size`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from jetflow_pl.runtime.contract import default_plugin_lib
from jetflow_pl.runtime.engine_config import load_engine_config
from jetflow_pl.runtime.graph_backend import GraphBackend
from jetflow_pl.runtime.kv_store import BufferKVStore, flat_view
from jetflow_pl.runtime.sequence import TapQueue

NO_TENSORRT = (
    "TensorRTBackend needs TensorRT (pip install 'jetflow-pl[tensorrt]' on a machine with an NVIDIA GPU); "
    "use OnnxRuntimeBackend for the ONNX graphs of the same engine directory"
)


def check_tree_size(num_nodes: int, max_nodes: int) -> None:
    """Refuse a tree the engine's optimization profile cannot take (TensorRT would fail the step opaquely)."""
    if num_nodes > max_nodes:
        raise ValueError(
            f"the draft tree has {num_nodes} nodes but the TensorRT engine's profile allows at most "
            f"{max_nodes}: use a draft budget <= {max_nodes - 1}, or rebuild the engines with a larger "
            f"max_tree (export.tensorrt_build.build_engines(..., max_tree={num_nodes}))"
        )


def import_tensorrt() -> ModuleType:
    """`import tensorrt`, or an ImportError that says what to install and what works without it."""
    try:
        import tensorrt
    except ImportError as err:
        raise ImportError(NO_TENSORRT) from err
    return tensorrt


def _torch_dtype(trt: ModuleType, dtype: Any) -> torch.dtype:
    table = {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "int32": torch.int32,
        "int64": torch.int64,
        "int8": torch.int8,
        "bool": torch.bool,
    }
    for name, torch_dtype in table.items():
        if hasattr(trt, name) and dtype == getattr(trt, name):
            return torch_dtype
    raise TypeError(f"engine tensor type {dtype} has no torch equivalent here")


class _Engine:
    """One deserialized engine, its execution context and a `run` that binds torch tensors by name."""

    def __init__(self, trt: ModuleType, runtime: Any, path: Path, version_built: str | None) -> None:
        if not path.is_file():
            raise FileNotFoundError(f"TensorRT engine not found: {path} (run jetflow-export --engine)")
        self.path = path
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            built = (
                f" (built with TensorRT {version_built}, this is {trt.__version__})" if version_built else ""
            )
            raise RuntimeError(
                f"TensorRT could not deserialize {path}{built}: engines only load on the TensorRT version "
                "and GPU they were built for, and a plugin engine needs the plugin library loaded; rebuild "
                "with jetflow-export --engine"
            )
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise RuntimeError(f"TensorRT could not create an execution context for {path}")
        self.trt = trt
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]

    def dtype(self, name: str) -> torch.dtype:
        return _torch_dtype(self.trt, self.engine.get_tensor_dtype(name))

    def max_shape(self, name: str) -> tuple[int, ...]:
        """The profile-0 maximum shape of input `name`."""
        return tuple(self.engine.get_tensor_profile_shape(name, 0)[2])

    def run(self, feeds: dict[str, torch.Tensor], outs: dict[str, torch.Tensor], stream: Any) -> None:
        """Bind `feeds` (inputs, shapes taken from them) and `outs` (views sized for the outputs); execute."""
        ctx = self.context
        for name in self.inputs:
            t = feeds[name]
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise RuntimeError(
                    f"{self.path.name}: input {name} shape {tuple(t.shape)} is outside the engine profile"
                )
            ctx.set_tensor_address(name, t.data_ptr())
        for name in self.outputs:
            t = outs[name]
            want = tuple(ctx.get_tensor_shape(name))
            if want != tuple(t.shape):  # the graph contract and this runtime disagree: a bug, not input
                raise RuntimeError(f"{self.path.name}: output {name} is {want}, buffer is {tuple(t.shape)}")
            ctx.set_tensor_address(name, t.data_ptr())
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT failed to run {self.path.name} (see its log)")


def _load_plugin(trt: ModuleType, explicit: str | Path | None, recorded: str | None) -> None:
    """Register the TreeAttention plugin before deserializing: a plugin engine names it, does not hold it."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise FileNotFoundError(f"plugin library {path} does not exist")
    else:
        candidates = [Path(recorded)] if recorded else []
        candidates.append(default_plugin_lib())
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            raise FileNotFoundError(
                "this plugin engine needs the TreeAttention plugin library; none of "
                f"{', '.join(map(str, candidates))} exists: pass plugin_lib= (trt_plugins/README.md)"
            )
    if trt.get_plugin_registry().load_library(str(path)) is None:
        raise RuntimeError(f"TensorRT could not load the plugin library {path}")


class TensorRTBackend(GraphBackend):
    """Speculative (or autoregressive) decoding on the TensorRT engines of an engine directory.

    `plugin_lib`: the TreeAttention plugin library for a `plugin` engine directory (default: the path
    recorded by the build, else `jetflow_pl.runtime.contract.default_plugin_lib()`). `topk` bounds the tree
    width exactly as for `OnnxRuntimeBackend` (`check_width`).
    """

    def __init__(
        self,
        engine_dir: str | Path,
        device: str | torch.device = "cuda",
        plugin_lib: str | Path | None = None,
    ) -> None:
        trt = import_tensorrt()
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(
                f"TensorRTBackend needs a CUDA device (got device={str(device)!r}, "
                f"torch.cuda.is_available()={torch.cuda.is_available()})"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        engine_dir = Path(engine_dir)
        config = load_engine_config(engine_dir)
        engines = config.get("engines") or {}
        if not engines.get("target") or not engines.get("head"):
            raise FileNotFoundError(
                f"{engine_dir} has no TensorRT engines in its config.json: build them with "
                "jetflow-export --engine (or export.tensorrt_build.build_engines)"
            )
        build = config.get("tensorrt") or {}
        self._logger = trt.Logger(trt.Logger.WARNING)
        if hasattr(trt, "init_libnvinfer_plugins"):
            trt.init_libnvinfer_plugins(self._logger, "")
        if config["variant"] == "plugin":
            _load_plugin(trt, plugin_lib, build.get("plugin_library"))
        with torch.cuda.device(device):
            # the runtime must outlive the engines it deserialized: keep it on the backend
            self._runtime = trt.Runtime(self._logger)
            target = _Engine(trt, self._runtime, engine_dir / engines["target"], build.get("version"))
            head = _Engine(trt, self._runtime, engine_dir / engines["head"], build.get("version"))
        self._setup(engine_dir, config, target, head, device)

    @classmethod
    def _from_engines(
        cls, engine_dir: str | Path, target: Any, head: Any, device: str | torch.device
    ) -> TensorRTBackend:
        """A backend over given engine objects (`max_shape`, `dtype`, `run` as `_Engine`).

        Lets the buffer and cache bookkeeping be tested on a CPU, with stand-in engines that run the
        ONNX graphs (tests/test_tensorrt.py); `__init__` is the only path that needs TensorRT and CUDA.
        """
        self = cls.__new__(cls)
        engine_dir = Path(engine_dir)
        self._setup(engine_dir, load_engine_config(engine_dir), target, head, torch.device(device))
        return self

    def _setup(
        self, engine_dir: Path, config: dict[str, Any], target: Any, head: Any, device: torch.device
    ) -> None:
        self.engine_dir = engine_dir
        self._target, self._head = target, head
        scope = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with scope:
            kv, head_kv, taps = self._allocate(config, device)
            super().__init__(config, device, kv=kv, head_kv=head_kv, taps=taps)

    def _allocate(
        self, config: dict[str, Any], device: torch.device
    ) -> tuple[BufferKVStore, BufferKVStore, TapQueue]:
        """Every large buffer of both engines, once, at the profile maxima (see the module docstring)."""
        tgt, head = self._target, self._head
        self._max_tree = int(tgt.max_shape("input_ids")[1])
        self._max_context = int(tgt.max_shape("past_keys")[3])
        t, h = config["target"], config["head"]
        rows = self._max_context + self._max_tree
        kv = BufferKVStore(
            t["num_layers"], t["num_kv_heads"], t["head_dim"], rows, tgt.dtype("past_keys"), device
        )
        vocab, features = int(config["vocab_size"]), int(h["tap_features"])
        self._features = features
        self._logits = torch.empty(self._max_tree * vocab, dtype=tgt.dtype("logits"), device=device)
        self._argmax = torch.empty(self._max_tree, dtype=tgt.dtype("argmax_ids"), device=device)
        self._taps = torch.empty(self._max_tree * features, dtype=tgt.dtype("taps"), device=device)

        b = int(config["block_size"])
        max_block = int(head.max_shape("block_ids")[1])
        if b > max_block:
            raise ValueError(f"block size {b} exceeds the head engine's profile ({max_block} rows)")
        self._head_max_context = int(head.max_shape("context_taps")[1])
        head_kv = BufferKVStore(
            h["num_layers"], h["num_kv_heads"], h["head_dim"], rows, head.dtype("past_keys"), device
        )
        pending = TapQueue(self._head_max_context, features, head.dtype("context_taps"), device)
        k = int(config["topk"])
        self._topk_values = torch.empty((1, b, k), dtype=head.dtype("topk_logprobs"), device=device)
        self._topk_ids = torch.empty((1, b, k), dtype=head.dtype("topk_ids"), device=device)
        return kv, head_kv, pending

    # ------------------------------------------------------------------ what the runtime states
    @property
    def max_positions(self) -> int:
        """The target's context limit, capped by what the engines' profiles (and buffers) hold."""
        return min(int(self.config["max_positions"]), self._max_context, self._head_max_context)

    @property
    def max_tree_nodes(self) -> int:
        """Largest tree one verify step takes (profile maximum of `N`); the decode loop bounds its budget."""
        return self._max_tree

    @property
    def max_prefill_rows(self) -> int:
        """The prompt goes through the verify profile too: chunks of at most `max_tree` rows."""
        return self._max_tree

    def host_logits(self, logits: Tensor) -> Tensor:
        # a copy (the buffer is rewritten by the next step), left on the GPU for the acceptance walk
        return logits.to(torch.float32, copy=True)

    def _device_scope(self) -> Any:
        """Make `self.device` current for TensorRT and torch (no-op for the CPU stand-in engines)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    @staticmethod
    def _inputs(engine: Any, feeds: dict[str, Tensor]) -> dict[str, Tensor]:
        """Feeds as the engine binds them: its dtypes, dense, and each at the start of its own memory
        (a view into the middle of a tensor, e.g. a prompt chunk, need not be aligned as TensorRT's
        kernels expect: it is copied)."""
        out = {}
        for name, t in feeds.items():
            want = engine.dtype(name)
            t = t if t.dtype == want else t.to(want)
            out[name] = t if t.is_contiguous() and t.storage_offset() == 0 else t.clone()
        return out

    # ------------------------------------------------------------------ graph runners
    def run_target(self, feeds: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        n = int(feeds["input_ids"].shape[1])
        check_tree_size(n, self._max_tree)
        present_keys, present_values = self.kv.present(n)
        outs = {
            "logits": flat_view(self._logits, (1, n, self.vocab_size)),
            "argmax_ids": flat_view(self._argmax, (1, n)),
            "taps": flat_view(self._taps, (1, n, self._features)),
            "present_keys": present_keys,
            "present_values": present_values,
        }
        self._target.run(self._inputs(self._target, feeds), outs, self._stream())
        return outs["logits"], outs["taps"], present_keys, present_values

    def run_head(self, feeds: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        present_keys, present_values = self.head_kv.present(int(feeds["context_taps"].shape[1]))
        # a causal head's draft may be cut to its first q rows (`SequenceBackend.block_rows`): the leading
        # q rows of the batch-1 buffers are a dense view of that shape
        q = int(feeds["block_ids"].shape[1])
        values, ids = self._topk_values[:, :q], self._topk_ids[:, :q]
        outs = {
            "topk_logprobs": values,
            "topk_ids": ids,
            "present_keys": present_keys,
            "present_values": present_values,
        }
        self._head.run(self._inputs(self._head, feeds), outs, self._stream())
        return values, ids, present_keys, present_values


def tensorrt_available() -> str | None:
    """None when TensorRT and a CUDA device are both here, else the reason (for test skips and tools)."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "TensorRT is not importable (pip install 'jetflow-pl[tensorrt]' on a GPU machine)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None
