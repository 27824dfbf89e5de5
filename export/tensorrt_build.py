"""TensorRT engines for an exported engine directory (`jetflow-export --engine`).

`build_engines` turns the two ONNX graphs of an engine directory into `target_verify.engine` and
`draft_head.engine` next to them and records them in `config.json` (`engines` plus a `tensorrt` block
with the optimization-profile limits the runtime must respect). Two graph variants build:

* `plugin`: the TreeAttention nodes become the `TreeAttention` plugin of `trt_plugins/`; its shared
  library is loaded into TensorRT's plugin registry before parsing (and again by the runtime before
  deserializing: the engine references the plugin, it does not contain its code);
* `portable`: standard ONNX ops only (attention as MatMul/Softmax over a mask unpacked in the graph),
  so it builds with no plugin at all. It is the plugin-free comparison build, and the graph that
  `tensorrt-rtx` (whose builder runs on a CPU but takes no custom plugins) lints in CI.

Why one profile, and why these limits: a verify step feeds `N` tree nodes (`1..max_tree`) after a cache
of `P` rows (`0..max_context`); the prompt is prefilled through the same graph in chunks of at most
`max_tree` rows (chain mask), so one profile covers both and the runtime needs one execution context per
engine. The head sees `T` new context rows (`1..max_context`: after the prefill that is the whole prompt)
and a block of `Q` rows (`1..max(max_tree, block_size)`).

This module imports `tensorrt` lazily: everything above the build itself (argument checks, profile
shapes) runs and is tested on machines without it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from jetflow_pl.errors import MissingPathError, UserInputError
from jetflow_pl.runtime.contract import (  # the plugin location is the runtime's, shared with the build
    HEAD_GRAPH,
    PLUGIN_LIB_ENV,
    TARGET_GRAPH,
    default_plugin_lib,
)
from jetflow_pl.runtime.engine_config import load_engine_config, write_engine_config

log = logging.getLogger(__name__)

HEAD_ENGINE = "draft_head.engine"
TARGET_ENGINE = "target_verify.engine"
TIMING_CACHE = "timing.cache"
PRECISIONS = ("fp32", "fp16", "bf16")
NO_TENSORRT = (
    "--engine needs TensorRT (pip install 'jetflow-pl[tensorrt]' on a machine with an NVIDIA GPU); "
    "ONNX graphs can still be exported without --engine"
)


class EngineBuildError(RuntimeError):
    """TensorRT could not parse or build a graph; the message carries the parser's / builder's errors."""


# ---------------------------------------------------------------------------------------------------
# checks that need no TensorRT
# ---------------------------------------------------------------------------------------------------


def resolve_plugin_lib(plugin_lib: str | Path | None, variant: str) -> Path | None:
    """The plugin library a `variant` build needs (None for `portable`); one `UserInputError` if missing.

    An explicit path must exist (a typo should not silently fall back to another build); without one the
    default location is used, and its absence is reported with the command that creates it.
    """
    if plugin_lib is not None:
        path = Path(plugin_lib)
        if not path.is_file():
            raise MissingPathError(
                f"--plugin-lib {path} does not exist (build it: see trt_plugins/README.md, 'Build')"
            )
        return path.resolve()
    if variant != "plugin":
        return None
    path = default_plugin_lib()
    if not path.is_file():
        raise UserInputError(
            f"the plugin variant needs the TreeAttention plugin library and none was given; the default "
            f"{path} does not exist: build it (trt_plugins/README.md, 'Build'), pass --plugin-lib PATH "
            f"(or set {PLUGIN_LIB_ENV}), or export --variant portable"
        )
    return path.resolve()


def import_tensorrt() -> ModuleType:
    """`import tensorrt`, or one `UserInputError` saying how to get it (the machine lacks it, not a bug)."""
    try:
        import tensorrt
    except ImportError as err:
        raise UserInputError(NO_TENSORRT) from err
    return tensorrt


def require_tensorrt(plugin_lib: str | Path | None = None, variant: str | None = None) -> Path | None:
    """Fail fast, before the slow ONNX export, when `--engine` cannot work here; return the plugin lib.

    Order: an explicit plugin path that does not exist (a typo, whatever the machine), then TensorRT
    itself, then (when `variant` is given) the default plugin build for the plugin variant. With
    `variant=None` only the first two are checked; `build_engines` resolves the default from the engine
    directory's variant.
    """
    if plugin_lib is not None:
        resolve_plugin_lib(plugin_lib, variant or "portable")
    import_tensorrt()
    return resolve_plugin_lib(plugin_lib, variant) if variant is not None else None


@dataclass(frozen=True)
class ProfileLimits:
    """Optimization-profile limits of both engines (see the module docstring for what each bounds).

    `opt_tree` / `opt_context` are the shapes TensorRT tunes kernels for: a typical decode tree and a
    half-full cache.
    """

    max_tree: int
    max_context: int
    opt_tree: int
    opt_context: int

    @classmethod
    def make(
        cls, max_tree: int, max_context: int, opt_tree: int | None = None, opt_context: int | None = None
    ) -> ProfileLimits:
        if max_tree < 1:
            raise UserInputError(f"max_tree must be >= 1, got {max_tree}")
        if max_context < 1:
            raise UserInputError(f"max_context must be >= 1, got {max_context}")
        opt_tree = min(max_tree, 64) if opt_tree is None else opt_tree
        opt_context = max_context // 2 if opt_context is None else opt_context
        if not 1 <= opt_tree <= max_tree:
            raise UserInputError(f"opt_tree must be in [1, {max_tree}], got {opt_tree}")
        if not 0 <= opt_context <= max_context:
            raise UserInputError(f"opt_context must be in [0, {max_context}], got {opt_context}")
        return cls(int(max_tree), int(max_context), int(opt_tree), int(opt_context))


Shape = tuple[int, ...]


def _words(n: int) -> int:
    return max(1, math.ceil(n / 32))


def profile_shapes(role: str, config: dict[str, Any], limits: ProfileLimits) -> dict[str, tuple[Shape, ...]]:
    """`{input name: (min, opt, max)}` for the `role` ("target" / "head") graph of an engine config.

    Shapes follow `jetflow_pl/runtime/contract.py`. Mask words are `ceil(rows / 32)` at each point, which is what
    `pack_mask` produces and what the runtime feeds.
    """
    lim = limits
    if role == "target":
        t = config["target"]
        kv = (t["num_layers"], 1, t["num_kv_heads"])
        d = t["head_dim"]
        n = (1, lim.opt_tree, lim.max_tree)
        p = (0, lim.opt_context, lim.max_context)
        return {
            "input_ids": tuple((1, x) for x in n),
            "position_ids": tuple((1, x) for x in n),
            "tree_mask": tuple((x, _words(x)) for x in n),
            "past_keys": tuple((*kv, x, d) for x in p),
            "past_values": tuple((*kv, x, d) for x in p),
        }
    if role == "head":
        h = config["head"]
        kv = (h["num_layers"], 1, h["num_kv_heads"])
        d = h["head_dim"]
        features = h["tap_features"]
        block = int(config["block_size"])
        q = (1, block, max(lim.max_tree, block))
        ctx = (1, min(lim.opt_tree, lim.max_context), lim.max_context)
        p = (0, lim.opt_context, lim.max_context)
        return {
            "context_taps": tuple((1, x, features) for x in ctx),
            "context_positions": tuple((1, x) for x in ctx),
            "block_ids": tuple((1, x) for x in q),
            "block_positions": tuple((1, x) for x in q),
            "block_mask": tuple((x, _words(x)) for x in q),
            "past_keys": tuple((*kv, x, d) for x in p),
            "past_values": tuple((*kv, x, d) for x in p),
        }
    raise ValueError(f"unknown graph role {role!r}: expected 'target' or 'head'")


# ---------------------------------------------------------------------------------------------------
# the build (needs a TensorRT module: `tensorrt`, or `tensorrt_rtx` for the CPU lint)
# ---------------------------------------------------------------------------------------------------


def load_plugin_library(trt: ModuleType, path: Path) -> Any:
    """Register the TreeAttention creator from `path` with TensorRT's plugin registry; return the handle."""
    registry = trt.get_plugin_registry()
    try:
        handle = registry.load_library(str(path))
    except Exception as err:  # the bindings raise on a library without getCreators / a bad ELF
        raise EngineBuildError(f"TensorRT could not load the plugin library {path}: {err}") from err
    if handle is None:
        raise EngineBuildError(f"TensorRT could not load the plugin library {path} (see the log above)")
    return handle


def parse_onnx(
    trt: ModuleType, builder: Any, logger: Any, onnx_path: Path, strongly_typed: bool
) -> tuple[Any, Any]:
    """Parse `onnx_path` into a new network; return (network, parser); raise `EngineBuildError` listing
    every parser error.

    `parse_from_file` (not `parse(bytes)`) so that graphs saved with external weights resolve them. The
    parser owns the weights the network points at, so the caller keeps it alive until the build is done.
    """
    flags = 0
    if strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    ok = parser.parse_from_file(str(onnx_path))
    errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
    if not ok or errors:
        detail = "\n  ".join(errors) or "no parser error recorded"
        raise EngineBuildError(f"TensorRT's ONNX parser rejected {onnx_path.name}:\n  {detail}")
    return network, parser


def allow_attention_decomposition(trt: ModuleType, network: Any) -> int:
    """Mark every parsed ONNX `Attention` (opset 23, TensorRT's IAttention) decomposable; return how many.

    TensorRT builds IAttention only where it has a fused kernel for the shapes and types (e.g. not fp32
    with an arbitrary boolean mask: tensorrt-rtx 1.7 fails the whole build there) unless the layer may
    fall back to MatMul/Softmax. The fused kernel is still chosen where one exists. A TensorRT without
    IAttention (before 10.14) has nothing to mark.
    """
    kind = getattr(trt.LayerType, "ATTENTION_INPUT", None)
    layer_class = getattr(trt, "IAttentionInputLayer", None)
    if kind is None or layer_class is None:
        return 0
    count = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == kind:
            layer.__class__ = layer_class  # the bindings return the ILayer base class
            layer.attention.decomposable = True
            count += 1
    return count


def _has_flag(trt: ModuleType, name: str) -> bool:
    return hasattr(trt.BuilderFlag, name)


def build_serialized_engine(
    trt: ModuleType,
    onnx_path: Path,
    shapes: dict[str, tuple[Shape, ...]],
    precision: str = "fp32",
    timing_cache: Path | None = None,
    logger: Any = None,
) -> bytes:
    """Parse and build one graph with one optimization profile; return the serialized engine.

    Precision: `fp32` clears TF32 (so fp32 engines agree with the torch backend to fp32 rounding);
    `fp16` / `bf16` allow those types (weakly typed network: TensorRT picks per layer; the graphs' I/O
    stays fp32/int64 as exported, and the TreeAttention plugin declares fp16/bf16 support). A TensorRT
    without those builder flags (e.g. tensorrt-rtx, strongly typed only) builds fp32 only.
    """
    if precision not in PRECISIONS:
        raise UserInputError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    logger = logger or trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    reduced = {"fp16": "FP16", "bf16": "BF16"}.get(precision)
    if reduced is not None and not _has_flag(trt, reduced):
        raise UserInputError(
            f"this TensorRT ({trt.__name__} {trt.__version__}) has no {reduced} builder flag: "
            "build with precision fp32"
        )
    # a TensorRT that cannot build weakly typed networks (no FP16 flag at all) gets a strongly typed one
    strongly_typed = not _has_flag(trt, "FP16")
    network, _parser = parse_onnx(trt, builder, logger, onnx_path, strongly_typed)
    allow_attention_decomposition(trt, network)
    config = builder.create_builder_config()
    if reduced is not None:
        config.set_flag(getattr(trt.BuilderFlag, reduced))
    elif _has_flag(trt, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    if inputs != set(shapes):
        raise EngineBuildError(
            f"{onnx_path.name} has inputs {sorted(inputs)}, the profile names {sorted(shapes)}: "
            "the graph does not follow jetflow_pl/runtime/contract.py (re-export it)"
        )
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    cache = None
    if timing_cache is not None:
        blob = timing_cache.read_bytes() if timing_cache.is_file() else b""
        cache = config.create_timing_cache(blob)
        config.set_timing_cache(cache, False)
    start = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(
            f"TensorRT failed to build {onnx_path.name} (profile {shapes}); see its log above"
        )
    log.info("built %s in %.1fs", onnx_path.name, time.perf_counter() - start)
    if cache is not None and timing_cache is not None:
        timing_cache.write_bytes(bytes(memoryview(config.get_timing_cache().serialize())))
    return bytes(memoryview(serialized))


def build_engines(
    engine_dir: str | Path,
    plugin_lib: str | Path | None = None,
    precision: str = "fp16",
    max_tree: int = 256,
    max_context: int | None = None,
    timing_cache: str | Path | None = None,
    opt_tree: int | None = None,
) -> dict[str, Any]:
    """Build `target_verify.engine` and `draft_head.engine` in `engine_dir`; update its `config.json`.

    `max_context` defaults to the target's `max_positions`. The timing cache defaults to
    `<engine_dir>/timing.cache` (shared by both builds, reused by rebuilds). The `plugin` variant loads
    `plugin_lib` (or the default build, see `resolve_plugin_lib`); the `portable` variant needs none.
    Returns the `tensorrt` block written to the config. Engines are written next to their final names
    and renamed into place only when both built, so a failed build leaves the directory as it was.
    """
    engine_dir = Path(engine_dir)
    try:
        config = load_engine_config(engine_dir)
    except (FileNotFoundError, ValueError) as err:
        raise UserInputError(str(err)) from err
    if config.get("batched", False):
        raise UserInputError(
            f"{engine_dir} holds batched graphs (jetflow-export --max-batch > 1): TensorRT engines are built "
            "from the batch-1 graphs (the TensorRT backend decodes one request per forward); re-export "
            "without --max-batch for --engine"
        )
    windows = [int(w) for w in config.get("target", {}).get("sliding_windows", []) if w]
    if windows and config["variant"] == "plugin":
        raise UserInputError(
            f"{engine_dir}: the target has sliding-window layers (window {windows[0]}) and the TreeAttention "
            "plugin's kernel has no window yet (the `window` attribute of its contract): export --variant "
            "attention (the window is in the mask the IAttention layer reads) or --variant portable"
        )
    plugin = resolve_plugin_lib(plugin_lib, config["variant"])
    trt = import_tensorrt()
    limits = ProfileLimits.make(
        max_tree, int(config["max_positions"]) if max_context is None else max_context, opt_tree
    )
    logger = trt.Logger(trt.Logger.WARNING)
    if hasattr(trt, "init_libnvinfer_plugins"):
        trt.init_libnvinfer_plugins(logger, "")
    if plugin is not None:
        load_plugin_library(trt, plugin)
    cache_path = Path(timing_cache) if timing_cache is not None else engine_dir / TIMING_CACHE
    files = {"target": (TARGET_GRAPH, TARGET_ENGINE), "head": (HEAD_GRAPH, HEAD_ENGINE)}
    partial: list[Path] = []
    try:
        for role, (graph, engine) in files.items():
            graph_file = config["graphs"][role]["file"] if role in config["graphs"] else graph
            blob = build_serialized_engine(
                trt,
                engine_dir / graph_file,
                profile_shapes(role, config, limits),
                precision,
                cache_path,
                logger,
            )
            tmp = engine_dir / f".{engine}.partial"
            tmp.write_bytes(blob)
            partial.append(tmp)
        for tmp in partial:
            os.replace(tmp, engine_dir / tmp.name[1 : -len(".partial")])
    finally:
        for tmp in partial:
            tmp.unlink(missing_ok=True)
    block = {
        "version": str(trt.__version__),
        "module": trt.__name__,
        "precision": precision,
        "max_tree": limits.max_tree,
        "max_context": limits.max_context,
        "opt_tree": limits.opt_tree,
        "opt_context": limits.opt_context,
        "max_block": max(limits.max_tree, int(config["block_size"])),
        "plugin_library": None if plugin is None else str(plugin),
        "timing_cache": str(cache_path),
    }
    config["engines"] = {"target": TARGET_ENGINE, "head": HEAD_ENGINE}
    config["tensorrt"] = block
    write_engine_config(engine_dir, config)
    return block
