"""The TensorRT backend: the engines of an engine directory (`jetflow-export --engine`) on one CUDA GPU.

Same protocol and bookkeeping as `OnnxRuntimeBackend` (and `TorchBackend`): `prefill` / `draft` /
`verify` / `commit`, the target KV cache and the head's context KV cache held by the runtime, tapped
features of committed rows queued for the next `draft`. What differs is where the memory lives and who
allocates it, following the TensorRT-LLM runtime pattern:

* every engine input and output is a torch CUDA tensor allocated once, at its profile's maximum size
  (`max_context + max_tree` cache rows); a step binds views of them (`set_tensor_address`), so decoding
  allocates no device memory and TensorRT writes its outputs straight into the buffers;
* the per-step tree inputs (token ids, position ids = `past_len + depth`, packed int32 mask) are copied
  into fixed buffers; the engines run on the current torch CUDA stream, so torch work and TensorRT work
  are ordered without extra synchronisation;
* KV caches are two preallocated buffers per cache (ping-pong). The graph contract hands the cache in as
  `past` `[L, 1, Hkv, P, d]` and returns `present` `[L, 1, Hkv, P + N, d]`; the present tensor goes to
  the other buffer. `commit` compacts the accepted rows (root path) back into the first buffer with one
  gather (`index_select(..., out=...)` into the preallocated memory). Because `P` is not the outermost
  axis, a cache of a different length has a different memory layout, so this gather moves the whole
  cache once per round (as the graph's own concat does); an in-place append would need a graph contract
  with fixed-capacity caches written at offset `P` (TensorRT's KV-cache update layer or a plugin output
  aliased to its input), which the exported graphs do not have yet.
* The prompt is prefilled through the verify engine in chunks of at most `max_tree` rows with a chain
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

from jetflow_pl.runtime.engine_config import load_engine_config
from jetflow_pl.tree import DraftTree, pack_mask

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
    from export.tensorrt_build import default_plugin_lib

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


def _view(buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A dense tensor of `shape` over the start of a flat preallocated `buffer` (no copy, no allocation).

    Always the start: every bound address is then the start of a CUDA allocation (256-byte aligned),
    which TensorRT's kernels expect; a view into the middle of a buffer would not be.
    """
    numel = 1
    for s in shape:
        numel *= s
    if numel > buffer.numel():
        raise RuntimeError(f"buffer of {buffer.numel()} elements is too small for {shape}")
    return buffer[:numel].view(shape)


class TensorRTBackend:
    """Speculative (or autoregressive) decoding on the TensorRT engines of an engine directory.

    `plugin_lib`: the TreeAttention plugin library for a `plugin` engine directory (default: the path
    recorded by the build, else `export.tensorrt_build.default_plugin_lib()`). `topk` bounds the tree
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
        self.config = config
        self.device = device
        self._target, self._head = target, head
        self._mask_token_id = int(config["mask_token_id"])
        self._vocab = int(config["vocab_size"])
        with self._on_device():
            self._allocate()
        self._reset()

    # ------------------------------------------------------------------ setup
    def _allocate(self) -> None:
        """Every buffer of both engines, once, at the profile maxima (see the module docstring)."""
        tgt, head = self._target, self._head
        dev = self.device
        self._max_tree = int(tgt.max_shape("input_ids")[1])
        self._max_context = int(tgt.max_shape("past_keys")[3])
        self._max_words = int(tgt.max_shape("tree_mask")[1])
        t, h = self.config["target"], self.config["head"]
        rows = self._max_context + self._max_tree
        self._kv_shape = (t["num_layers"], 1, t["num_kv_heads"])
        self._kv_d = int(t["head_dim"])
        kv_numel = t["num_layers"] * t["num_kv_heads"] * rows * self._kv_d
        kv_dtype = tgt.dtype("past_keys")
        # [cache][keys/values]: cache 0 holds the committed rows, cache 1 receives `present`
        self._kv = [[torch.empty(kv_numel, dtype=kv_dtype, device=dev) for _ in range(2)] for _ in range(2)]
        self._ids = torch.zeros(self._max_tree, dtype=tgt.dtype("input_ids"), device=dev)
        self._pos = torch.zeros(self._max_tree, dtype=tgt.dtype("position_ids"), device=dev)
        self._mask = torch.zeros(self._max_tree * self._max_words, dtype=torch.int32, device=dev)
        vocab = int(self.config["vocab_size"])
        self._logits = torch.empty(self._max_tree * vocab, dtype=tgt.dtype("logits"), device=dev)
        self._argmax = torch.empty(self._max_tree, dtype=tgt.dtype("argmax_ids"), device=dev)
        features = int(h["tap_features"])
        self._features = features
        self._taps = torch.empty(self._max_tree * features, dtype=tgt.dtype("taps"), device=dev)
        self._rows = torch.arange(rows, dtype=torch.int64, device=dev)

        # head: pending context (taps of committed rows not yet seen by the head), block, cache
        b = self.block_size
        max_block = int(head.max_shape("block_ids")[1])
        if b > max_block:
            raise ValueError(f"block size {b} exceeds the head engine's profile ({max_block} rows)")
        self._head_max_context = int(head.max_shape("context_taps")[1])
        self._pending = torch.empty(rows * features, dtype=head.dtype("context_taps"), device=dev)
        self._pending_pos = torch.empty(rows, dtype=torch.int64, device=dev)
        self._head_kv_shape = (h["num_layers"], 1, h["num_kv_heads"])
        self._head_d = int(h["head_dim"])
        head_numel = h["num_layers"] * h["num_kv_heads"] * rows * self._head_d
        head_dtype = head.dtype("past_keys")
        self._head_kv = [
            [torch.empty(head_numel, dtype=head_dtype, device=dev) for _ in range(2)] for _ in range(2)
        ]
        self._block_ids = torch.empty((1, b), dtype=torch.int64, device=dev)
        self._block_pos = torch.empty((1, b), dtype=torch.int64, device=dev)
        block = torch.ones(b, b, dtype=torch.bool)
        self._block_mask = pack_mask(block.tril() if self.config["causal_head"] else block).to(dev)
        k = self.topk
        self._topk_values = torch.empty((1, b, k), dtype=head.dtype("topk_logprobs"), device=dev)
        self._topk_ids = torch.empty((1, b, k), dtype=head.dtype("topk_ids"), device=dev)

    # ------------------------------------------------------------------ properties
    @property
    def block_size(self) -> int:
        return int(self.config["block_size"])

    @property
    def past_len(self) -> int:
        return self._past_len

    @property
    def max_positions(self) -> int:
        """The target's context limit, capped by what the engines' profiles (and buffers) hold."""
        return min(int(self.config["max_positions"]), self._max_context, self._head_max_context)

    @property
    def max_tree_nodes(self) -> int:
        """Largest tree one verify step takes (profile maximum of `N`); the decode loop bounds its budget."""
        return self._max_tree

    @property
    def topk(self) -> int:
        return int(self.config["topk"])

    def check_width(self, width: int) -> None:
        if width > self.topk:
            raise ValueError(
                f"tree width {width} exceeds the engine's top-k ({self.topk}): re-export with --topk >= {width}"
            )

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        self._past_len = 0  # rows in target cache 0
        self._head_len = 0  # rows in head cache 0
        self._num_pending = 0  # rows queued in `_pending` for the next draft
        self._tree_nodes: int | None = None  # N of the last verify (its present sits in cache 1)

    def _stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _on_device(self) -> Any:
        """Make `self.device` current for TensorRT and torch (no-op for the CPU stand-in engines)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _target_kv(self, cache: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*self._kv_shape, rows, self._kv_d)
        return _view(self._kv[cache][0], shape), _view(self._kv[cache][1], shape)

    def _head_cache(self, cache: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*self._head_kv_shape, rows, self._head_d)
        return _view(self._head_kv[cache][0], shape), _view(self._head_kv[cache][1], shape)

    def _run_target(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> int:
        """One verify-engine step over `n` new rows after cache 0; `present` lands in cache 1."""
        n = int(ids.numel())
        check_tree_size(n, self._max_tree)
        words = int(mask.shape[1])
        ids_v = _view(self._ids, (1, n))
        pos_v = _view(self._pos, (1, n))
        mask_v = _view(self._mask, (n, words))
        ids_v.copy_(ids.reshape(1, n))
        pos_v.copy_(positions.reshape(1, n))
        mask_v.copy_(mask)
        p = self._past_len
        past_k, past_v = self._target_kv(0, p)
        pres_k, pres_v = self._target_kv(1, p + n)
        self._target.run(
            {
                "input_ids": ids_v,
                "position_ids": pos_v,
                "tree_mask": mask_v,
                "past_keys": past_k,
                "past_values": past_v,
            },
            {
                "logits": _view(self._logits, (1, n, self._vocab)),
                "argmax_ids": _view(self._argmax, (1, n)),
                "taps": _view(self._taps, (1, n, self._features)),
                "present_keys": pres_k,
                "present_values": pres_v,
            },
            self._stream(),
        )
        return n

    def _queue(self, taps: torch.Tensor, first_position: int) -> None:
        """Append tapped features `[1, k, F]` of committed rows at positions `first_position..` to the queue."""
        k = int(taps.shape[1])
        start = self._num_pending
        if start + k > self._head_max_context:
            raise ValueError(
                f"{start + k} context rows wait for the head, its engine profile takes {self._head_max_context}"
            )
        dst = self._pending[start * self._features : (start + k) * self._features].view(1, k, self._features)
        dst.copy_(taps)
        self._pending_pos[start : start + k] = self._rows[first_position : first_position + k]
        self._num_pending += k

    # ------------------------------------------------------------------ protocol
    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(prompt_ids).reshape(-1).to(torch.int64)
        if ids.numel() == 0:
            raise ValueError("prompt is empty: at least one token is needed to start decoding")
        if ids.numel() > self.max_positions:
            raise ValueError(
                f"prompt of {ids.numel()} tokens exceeds the engines' context limit of {self.max_positions}"
            )
        self._reset()
        with self._on_device():
            ids = ids.to(self.device)
            total = int(ids.numel())
            last = 0
            for start in range(0, total, self._max_tree):
                chunk = ids[start : start + self._max_tree]
                n = int(chunk.numel())
                chain = pack_mask(torch.ones(n, n, dtype=torch.bool).tril())
                self._run_target(chunk, self._rows[start : start + n], chain)
                # the chunk's present (all rows so far) becomes the committed cache: swap, no copy
                self._kv.reverse()
                self._past_len += n
                self._queue(_view(self._taps, (1, n, self._features)), start)
                last = n
            return _view(self._logits, (1, last, self._vocab))[0, -1].float().clone()

    @torch.no_grad()
    def draft(self, anchor_token: int) -> torch.Tensor:
        if self._num_pending == 0:
            raise RuntimeError("draft() needs new context rows: call prefill() or commit() first")
        b = self.block_size
        t = self._num_pending
        with self._on_device():
            self._block_ids.fill_(self._mask_token_id)
            self._block_ids[0, 0] = int(anchor_token)
            torch.add(self._rows[:b], self._past_len, out=self._block_pos[0])
            p = self._head_len
            past_k, past_v = self._head_cache(0, p)
            pres_k, pres_v = self._head_cache(1, p + t)
            self._head.run(
                {
                    "context_taps": self._pending[: t * self._features].view(1, t, self._features),
                    "context_positions": self._pending_pos[:t].view(1, t),
                    "block_ids": self._block_ids,
                    "block_positions": self._block_pos,
                    "block_mask": self._block_mask,
                    "past_keys": past_k,
                    "past_values": past_v,
                },
                {
                    "topk_logprobs": self._topk_values,
                    "topk_ids": self._topk_ids,
                    "present_keys": pres_k,
                    "present_values": pres_v,
                },
                self._stream(),
            )
            self._head_kv.reverse()
            self._head_len = p + t
            self._num_pending = 0
            values = self._topk_values[0, 1:].float().cpu()
            ids = self._topk_ids[0, 1:].to(torch.int64).cpu()
        # the tree builder reads per-depth log-probs over the vocabulary (as OnnxRuntimeBackend does)
        dense = torch.full((b - 1, self._vocab), float("-inf"))
        dense.scatter_(1, ids, values)
        return dense

    @torch.no_grad()
    def verify(self, tree: DraftTree) -> torch.Tensor:
        check_tree_size(tree.num_nodes, self._max_tree)
        with self._on_device():
            n = self._run_target(tree.tokens, tree.position_ids(self._past_len), tree.packed_mask())
            self._tree_nodes = n
            # a copy: the buffer is rewritten by the next step, the caller may keep the logits longer
            return _view(self._logits, (1, n, self._vocab))[0].clone()

    @torch.no_grad()
    def commit(self, accepted: list[int]) -> None:
        if self._tree_nodes is None:
            raise RuntimeError("commit() without a preceding verify()")
        p, n, a = self._past_len, self._tree_nodes, len(accepted)
        with self._on_device():
            acc = torch.as_tensor(accepted, dtype=torch.int64).to(self.device)
            keep = torch.cat([self._rows[:p], acc + p])
            present = self._target_kv(1, p + n)
            compacted = self._target_kv(0, p + a)
            for src, dst in zip(present, compacted, strict=True):
                torch.index_select(src, 3, keep, out=dst)
            taps = _view(self._taps, (1, n, self._features))
            self._queue(taps.index_select(1, acc), p)
        self._tree_nodes = None
        self._past_len = p + a


def tensorrt_available() -> str | None:
    """None when TensorRT and a CUDA device are both here, else the reason (for test skips and tools)."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "TensorRT is not importable (pip install 'jetflow-pl[tensorrt]' on a GPU machine)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None
