#!/usr/bin/env python
"""One-command GPU check for the `jetflow::tree_attention` kernels and the TensorRT export.

Why this exists: development and CI machines have no GPU, and GPU time is lent briefly and by chance.
This script runs every GPU-only check in one go (under 8 minutes on one H200), records everything in one
JSON file and prints a short table, so a single lent session yields a complete, reviewable result.

Steps (each runs in its own subprocess with a timeout, so a crash, a hang or a poisoned CUDA context in
one step cannot take the others down; results are written to the JSON after every step):

    cuda_ext_build     build/load the CUDA torch extension (trt_plugins/tree_attention/torch_ext)
    cuda_ext_numerics  the extension vs `tree_attention_reference` (fp64) over dtypes, d, N, P, GQA
    triton_numerics    the compiled Triton kernel vs the same reference and shapes
    timing             SDPA with a dense mask vs the extension vs the Triton kernel (decode-like shapes)
    pytest_gpu         `pytest -m gpu`
    tensorrt_engines   where `import tensorrt` works: CMake-build the TreeAttention plugin, then
                       `jetflow-export --engine` for both variants, and run each engine once at its
                       optimisation-profile `opt` shapes (outputs must be finite)

`--dry-run` (automatic when no CUDA device is present) goes through the same orchestration on the CPU
and records every step as skipped with its reason; it is what the CPU test suite runs. `--cpu-smoke`
is a development aid: it runs the Triton numerics and timing steps on the CPU under the Triton
interpreter at tiny shapes, to exercise the step code without a GPU.

Usage: bash scripts/gpu_check.sh [--out gpu_check_results/results.json] [--only STEP ...] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path("gpu_check_results/results.json")
DEFAULT_BUDGET_S = 450.0  # the whole run; gpu_check.sh adds a hard 8-minute cap around it
STATUS_PASSED, STATUS_FAILED, STATUS_SKIPPED = "passed", "failed", "skipped"

# (B, Hq, Hkv, N, P, d): numerics shapes (every dtype) - MHA/GQA, one/multi-word masks, P 0..2048
NUMERICS_SHAPES = [
    (1, 8, 8, 16, 0, 64),
    (2, 8, 2, 100, 37, 64),
    (1, 4, 1, 256, 0, 64),
    (1, 32, 8, 64, 512, 128),
    (1, 28, 4, 33, 1000, 128),
    (1, 16, 4, 256, 2048, 128),
]
QUICK_NUMERICS_SHAPES = [NUMERICS_SHAPES[1], NUMERICS_SHAPES[5]]
NUMERICS_DTYPES = ("float32", "float16", "bfloat16")
# max abs error vs an fp64 reference computed from the same (rounded) inputs
TOLERANCES = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}
# decode-like timing shapes (B, Hq, Hkv, N, P, d), fp16 and bf16
TIMING_SHAPES = [
    (1, 32, 8, 16, 2048, 128),
    (1, 32, 8, 64, 2048, 128),
    (1, 32, 8, 256, 2048, 128),
    (1, 32, 8, 64, 512, 128),
    (1, 32, 8, 256, 0, 128),
    (1, 16, 4, 64, 2048, 64),
]
TIMING_DTYPES = ("float16", "bfloat16")
# --cpu-smoke: tiny shapes the Triton interpreter runs in seconds
SMOKE_SHAPES = [(1, 2, 1, 16, 0, 16), (1, 4, 2, 40, 24, 16)]


class Skip(Exception):
    """Raised by a step that cannot run here; the message is the recorded reason."""


class StepFailed(Exception):
    """Raised by a step whose checks ran and failed; the message is the recorded summary."""


@dataclass
class Step:
    name: str
    fn: Callable[[Context, Recorder], str]
    timeout_s: float
    what: str
    needs_cuda: bool = True
    cpu_smoke: bool = False  # runs under --cpu-smoke


@dataclass
class Context:
    """What a step process knows: the CLI options and the results of the steps before it."""

    args: argparse.Namespace
    device: str  # "cuda", or "cpu" under --cpu-smoke
    previous: dict[str, dict[str, Any]]
    work_dir: Path

    @property
    def quick(self) -> bool:
        return bool(self.args.quick) or self.device == "cpu"

    def limit(self, seconds: float) -> float:
        """`seconds`, cut so a subprocess of this step ends (and is killed) before the step's own deadline.

        The orchestrator kills a late step's process group, which does not reach a subprocess the step
        started in its own group, so nested timeouts must expire first.
        """
        deadline = getattr(self.args, "deadline_epoch", None)
        if deadline is None:
            return seconds
        return max(1.0, min(seconds, deadline - time.time() - 5.0))

    def passed(self, step: str) -> bool:
        return self.previous.get(step, {}).get("status") == STATUS_PASSED


class Recorder:
    """A step's `details`, flushed to its result file as they grow (kept if the process dies)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.details: dict[str, Any] = {}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"partial": True, "details": self.details}, indent=1, default=str))
        tmp.replace(self.path)


# --------------------------------------------------------------------------------------------------
# shared helpers (imported lazily inside steps: the orchestrator and skipped steps never import torch)
# --------------------------------------------------------------------------------------------------


def _random_tree_mask(n: int, gen: Any) -> Any:
    """Packed ancestor mask of a random tree (each node's parent uniform among earlier nodes)."""
    import torch

    from jetflow_pl.tree import DraftTree

    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return DraftTree.from_parents(torch.zeros(n, dtype=torch.long), torch.tensor(parents)).packed_mask()


def _make_inputs(shape: tuple[int, ...], dtype_name: str, device: str, seed: int) -> tuple[Any, ...]:
    """(query, past_key, past_value, key, value, packed_mask) on `device`, deterministic per seed."""
    import torch

    b, hq, hkv, n, p, d = shape
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype_name)

    def rnd(*s: int) -> Any:
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype)

    mask = _random_tree_mask(n, gen).to(device)
    return rnd(b, hq, n, d), rnd(b, hkv, p, d), rnd(b, hkv, p, d), rnd(b, hkv, n, d), rnd(b, hkv, n, d), mask


def _reference_fp64(inputs: tuple[Any, ...], scale: float) -> Any:
    from jetflow_pl.ops.tree_attention import tree_attention_reference

    q, pk, pv, k, v, mask = inputs
    return tree_attention_reference(q.double(), pk.double(), pv.double(), k.double(), v.double(), mask, scale)


def _shape_label(shape: tuple[int, ...]) -> str:
    b, hq, hkv, n, p, d = shape
    return f"B{b} Hq{hq}/Hkv{hkv} N{n} P{p} d{d}"


def _check_numerics(rec: Recorder, ctx: Context, impl: Callable[..., Any], key: str) -> str:
    """Compare `impl` with the fp64 reference on every (shape, dtype); record max errors."""
    import torch

    shapes = (
        SMOKE_SHAPES if ctx.device == "cpu" else (QUICK_NUMERICS_SHAPES if ctx.quick else NUMERICS_SHAPES)
    )
    dtypes = ("float32",) if ctx.device == "cpu" else NUMERICS_DTYPES
    rows: list[dict[str, Any]] = []
    rec.details[key] = rows
    failures = 0
    for si, shape in enumerate(shapes):
        for dtype_name in dtypes:
            row: dict[str, Any] = {"shape": _shape_label(shape), "dtype": dtype_name}
            rows.append(row)
            try:
                inputs = _make_inputs(shape, dtype_name, ctx.device, seed=100 + si)
                scale = shape[-1] ** -0.5
                out = impl(*inputs, scale)
                if ctx.device == "cuda":
                    torch.cuda.synchronize()
                ref = _reference_fp64(inputs, scale)
                err = (out.double() - ref).abs().max().item()
                row.update(
                    max_abs_err=err, tol=TOLERANCES[dtype_name], ok=bool(err <= TOLERANCES[dtype_name])
                )
                row["dtype_ok"] = out.dtype == inputs[0].dtype and tuple(out.shape) == tuple(inputs[0].shape)
                row["ok"] = row["ok"] and row["dtype_ok"]
            except Exception as exc:  # record and go on: one bad shape should not hide the others
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
            failures += not row["ok"]
            rec.save()
    total = len(rows)
    worst = {
        dt: max((r["max_abs_err"] for r in rows if r["dtype"] == dt and "max_abs_err" in r), default=None)
        for dt in dtypes
    }
    summary = f"{total - failures}/{total} within tolerance; worst " + ", ".join(
        f"{dt} {w:.2e}" for dt, w in worst.items() if w is not None
    )
    if failures:
        raise StepFailed(summary)
    return summary


def _cuda_ext() -> tuple[Callable[..., Any], Callable[..., Any]]:
    # the repository root is on PYTHONPATH: `run_all` puts it there for every step process
    from trt_plugins.tree_attention.torch_ext import load_extension, tree_attention_cuda

    return load_extension, tree_attention_cuda


def _time_call(fn: Callable[[], Any], device: str, reps: int, rounds: int = 5) -> float:
    """Median over `rounds` of the mean time per call (ms) of `reps` back-to-back calls, after warm-up."""
    import torch

    for _ in range(3):
        fn()
    samples = []
    for _ in range(rounds):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(samples)


def run_killable(cmd: list[str], timeout: float, **kwargs: Any) -> tuple[int | None, str]:
    """Run `cmd` in its own process group, output merged; on timeout kill the whole group (rc None).

    A plain `subprocess.run(timeout=...)` kills only the child: a grandchild (pytest's own subprocesses,
    the export CLI's builder) would keep the output pipe open and the wait would hang past the budget.
    """
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out = ""
        return None, (out or "") + f"\n[gpu_check] killed after {timeout:.0f} s"


# --------------------------------------------------------------------------------------------------
# steps
# --------------------------------------------------------------------------------------------------


def step_cuda_ext_build(ctx: Context, rec: Recorder) -> str:
    ext_dir = REPO / "trt_plugins" / "tree_attention" / "torch_ext"
    if not ext_dir.exists():
        raise StepFailed(
            f"{ext_dir.relative_to(REPO)} does not exist (the CUDA extension is not in this tree)"
        )
    rec.details["nvcc"] = shutil.which("nvcc")
    rec.details["TORCH_EXTENSIONS_DIR"] = os.environ.get("TORCH_EXTENSIONS_DIR")
    t0 = time.perf_counter()
    load_extension, _ = _cuda_ext()
    try:  # verbose: nvcc's output lands in this process's output, which a failed step records
        module = load_extension(verbose=True)
    except TypeError:
        module = load_extension()
    rec.details["build_s"] = round(time.perf_counter() - t0, 1)
    rec.details["module"] = repr(module)[:200]
    return f"built/loaded in {rec.details['build_s']} s"


def step_cuda_ext_numerics(ctx: Context, rec: Recorder) -> str:
    if not ctx.passed("cuda_ext_build"):
        raise Skip("cuda_ext_build did not pass")
    load_extension, tree_attention_cuda = _cuda_ext()
    load_extension()
    return _check_numerics(rec, ctx, tree_attention_cuda, "cases")


def step_triton_numerics(ctx: Context, rec: Recorder) -> str:
    if ctx.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    from jetflow_pl.ops.triton_tree_attention import is_triton_available, tree_attention_triton

    if not is_triton_available():
        raise Skip("triton is not importable")
    import triton

    rec.details["triton_version"] = triton.__version__
    return _check_numerics(rec, ctx, tree_attention_triton, "cases")


def step_timing(ctx: Context, rec: Recorder) -> str:
    """SDPA with a dense additive mask (torch picks its backend) vs the CUDA extension vs Triton."""
    import torch
    import torch.nn.functional as F

    from jetflow_pl.ops.tree_attention import packed_mask_to_dense

    impls: dict[str, Callable[..., Any]] = {}
    notes: dict[str, str] = {}
    if ctx.passed("cuda_ext_numerics"):
        load_extension, tree_attention_cuda = _cuda_ext()
        load_extension()
        impls["cuda_ext"] = tree_attention_cuda
    else:
        notes["cuda_ext"] = "not timed: cuda_ext_numerics did not pass"
    if ctx.passed("triton_numerics"):
        if ctx.device == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"
        else:
            os.environ.pop("TRITON_INTERPRET", None)
        from jetflow_pl.ops.triton_tree_attention import tree_attention_triton

        impls["triton"] = tree_attention_triton
    else:
        notes["triton"] = "not timed: triton_numerics did not pass"
    rec.details["notes"] = notes
    rows: list[dict[str, Any]] = []
    rec.details["rows"] = rows
    shapes = SMOKE_SHAPES if ctx.device == "cpu" else (TIMING_SHAPES[:3] if ctx.quick else TIMING_SHAPES)
    dtypes = ("float32",) if ctx.device == "cpu" else TIMING_DTYPES
    reps = 3 if ctx.device == "cpu" else 50
    for si, shape in enumerate(shapes):
        for dtype_name in dtypes:
            row: dict[str, Any] = {"shape": _shape_label(shape), "dtype": dtype_name}
            rows.append(row)
            q, pk, pv, k, v, mask = _make_inputs(shape, dtype_name, ctx.device, seed=200 + si)
            n, p = shape[3], shape[4]
            scale = shape[-1] ** -0.5
            # The SDPA baseline gets everything a runtime would keep ready: K/V already concatenated and
            # expanded to the query heads, an additive mask already built. Only the attention is timed.
            group = shape[1] // shape[2]
            keys = torch.cat([pk, k], dim=2).repeat_interleave(group, dim=1)
            values = torch.cat([pv, v], dim=2).repeat_interleave(group, dim=1)
            visible = torch.cat(
                [torch.ones(n, p, dtype=torch.bool, device=q.device), packed_mask_to_dense(mask, n)], dim=1
            )
            additive = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
            additive.masked_fill_(~visible, float("-inf"))

            def sdpa(q=q, keys=keys, values=values, additive=additive[None, None], scale=scale) -> Any:
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=additive, scale=scale)

            calls = {"sdpa_dense": sdpa}
            for name, impl in impls.items():
                calls[name] = lambda impl=impl, q=q, pk=pk, pv=pv, k=k, v=v, mask=mask, scale=scale: impl(
                    q, pk, pv, k, v, mask, scale
                )
            for name, call in calls.items():
                try:
                    row[f"{name}_ms"] = round(_time_call(call, ctx.device, reps), 4)
                except Exception as exc:
                    row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            rec.save()
    if "triton" in impls and ctx.device == "cuda" and not ctx.quick:
        if ctx.limit(1e9) > 60:  # optional extra: only with a minute of this step's time left
            rec.details["triton_sweep"] = _triton_sweep(impls["triton"], rec)
        else:
            notes["triton_sweep"] = "skipped: less than 60 s of the step's time left"
    errors = [key for row in rows for key in row if key.endswith("_error")]
    timed = sorted({key[:-3] for row in rows for key in row if key.endswith("_ms")})
    summary = f"{len(rows)} shapes x dtypes; timed {', '.join(timed) or 'nothing'}"
    if errors:
        raise StepFailed(f"{summary}; {len(errors)} timing call(s) raised")
    return summary


def _triton_sweep(impl: Callable[..., Any], rec: Recorder) -> list[dict[str, Any]]:
    """Time a few tile / warp / split settings of the Triton kernel on two decode shapes (fp16).

    Why: GPU time is scarce and the kernel's defaults were chosen without a GPU; one loan should also
    say which settings to make the defaults. Errors are recorded per setting and never fail the step.
    """
    settings = [
        {},
        {"num_splits": 1},
        {"block_m": 64, "block_n": 128, "num_warps": 8},
        {"block_m": 64, "block_n": 32, "num_stages": 3},
        {"block_m": 128, "block_n": 64, "num_warps": 8},
        {"block_m": 32, "block_n": 64},
        {"num_warps": 8, "num_stages": 3},
    ]
    sweep: list[dict[str, Any]] = []
    for si, shape in enumerate((TIMING_SHAPES[1], TIMING_SHAPES[2])):
        args = (*_make_inputs(shape, "float16", "cuda", seed=300 + si), shape[-1] ** -0.5)
        for kw in settings:
            row: dict[str, Any] = {"shape": _shape_label(shape), "settings": kw or "defaults"}
            sweep.append(row)
            try:
                row["ms"] = round(_time_call(partial(impl, *args, **kw), "cuda", 50), 4)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rec.save()
    return sweep


def _trt_torch_dtype(trt: Any, dt: Any) -> Any:
    import torch

    table = {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.int32: torch.int32,
        trt.int64: torch.int64,
        trt.bool: torch.bool,
    }
    if hasattr(trt, "bfloat16"):
        table[trt.bfloat16] = torch.bfloat16
    return table[dt]


def _run_engine(trt: Any, path: Path, vocab_size: int) -> dict[str, Any]:
    """Deserialise an engine, run it once at its profile-0 `opt` shapes with plausible inputs, time it."""
    import torch

    from jetflow_pl.tree import pack_mask

    logger = trt.Logger(trt.Logger.WARNING)
    trt.init_libnvinfer_plugins(logger, "")
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise RuntimeError(f"could not deserialise {path.name}")
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [nm for nm in names if engine.get_tensor_mode(nm) == trt.TensorIOMode.INPUT]
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, Any] = {}
    info: dict[str, Any] = {"inputs": {}, "outputs": {}}
    shapes = {nm: list(engine.get_tensor_profile_shape(nm, 0)[1]) for nm in inputs}
    past = next((s[3] for nm, s in shapes.items() if nm.startswith("past_") and len(s) == 5), 0)
    for nm in inputs:
        shape = shapes[nm]
        dtype = _trt_torch_dtype(trt, engine.get_tensor_dtype(nm))
        if "mask" in nm:  # chain (causal) mask over the rows, padded/cut to the profile's word count
            rows = shape[0]
            t = pack_mask(torch.ones(rows, rows, dtype=torch.bool).tril())
            t = torch.nn.functional.pad(t, (0, max(0, shape[1] - t.shape[1])))[:, : shape[1]]
        elif "position" in nm:
            t = (past + torch.arange(shape[-1])).reshape(shape)
        elif dtype in (torch.int32, torch.int64):
            t = torch.randint(0, max(2, vocab_size), shape, generator=gen)
        else:
            t = 0.5 * torch.randn(*shape, generator=gen)
        t = t.to(device="cuda", dtype=dtype).contiguous()
        tensors[nm] = t
        context.set_input_shape(nm, tuple(shape))
        info["inputs"][nm] = shape
    for nm in names:
        if nm in tensors:
            continue
        shape = list(context.get_tensor_shape(nm))
        tensors[nm] = torch.empty(
            shape, dtype=_trt_torch_dtype(trt, engine.get_tensor_dtype(nm)), device="cuda"
        )
        info["outputs"][nm] = shape
    for nm, t in tensors.items():
        context.set_tensor_address(nm, t.data_ptr())
    torch.cuda.synchronize()  # inputs were written on the default stream
    stream = torch.cuda.Stream()

    def run() -> None:
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("execute_async_v3 returned False")

    with torch.cuda.stream(stream):
        run()
        stream.synchronize()
        info["finite_outputs"] = {
            nm: bool(torch.isfinite(tensors[nm].float()).all())
            for nm in info["outputs"]
            if tensors[nm].is_floating_point()
        }
        info["latency_ms"] = round(_time_call(run, "cuda", reps=20, rounds=3), 4)
    return info


def _find_head(ctx: Context) -> Path:
    """`--head`, else the shipped toy head, else the quickstart run's head, else a seeded random head."""
    if ctx.args.head:
        return Path(ctx.args.head)
    for candidate in (REPO / "data_gen/toy/assets/small_head", REPO / "runs/quickstart/head/best"):
        if (candidate / "config.json").exists():
            return candidate
    from transformers import AutoTokenizer

    from jetflow_pl.decode_options import load_head_or_untrained
    from jetflow_pl.target import TargetModel

    target_dir = Path(ctx.args.target)
    head = load_head_or_untrained(
        None, TargetModel.from_pretrained(target_dir), AutoTokenizer.from_pretrained(target_dir)
    )
    out = ctx.work_dir / "random_head"
    head.save_pretrained(out)
    return out


def _build_trt_plugin(ctx: Context, rec: Recorder) -> Path:
    """CMake-build `libjetflow_trt_plugins.so` (TensorRT headers via TensorRT_ROOT or default paths)."""
    import torch

    src = REPO / "trt_plugins" / "tree_attention"
    cmake = shutil.which("cmake")
    if not (src / "CMakeLists.txt").exists() or cmake is None:
        raise RuntimeError(
            f"cannot build the plugin: CMakeLists.txt present={(src / 'CMakeLists.txt').exists()}, cmake={cmake}"
        )
    build = ctx.work_dir / "trt_plugin_build"
    arch = "".join(map(str, torch.cuda.get_device_capability(0)))
    configure = [cmake, "-S", str(src), "-B", str(build), f"-DCMAKE_CUDA_ARCHITECTURES={arch}"]
    if os.environ.get("TensorRT_ROOT"):
        configure.append(f"-DTensorRT_ROOT={os.environ['TensorRT_ROOT']}")
    entry: dict[str, Any] = {}
    rec.details["plugin_build"] = entry
    for label, cmd, limit in (
        ("configure", configure, 90.0),
        ("build", [cmake, "--build", str(build), "-j"], 240.0),
    ):
        t0 = time.perf_counter()
        rc, out = run_killable(cmd, ctx.limit(limit), cwd=REPO)
        entry[label] = {
            "cmd": " ".join(cmd),
            "rc": rc,
            "seconds": round(time.perf_counter() - t0, 1),
            "output_tail": out[-2500:],
        }
        rec.save()
        if rc != 0:
            raise RuntimeError(f"plugin {label} failed (rc={rc})")
    lib = build / "libjetflow_trt_plugins.so"
    if not lib.exists():
        raise RuntimeError(f"plugin build succeeded but {lib} is missing")
    entry["library"] = str(lib)
    return lib


def step_tensorrt_engines(ctx: Context, rec: Recorder) -> str:
    try:
        import tensorrt as trt
    except Exception as exc:
        raise Skip(f"`import tensorrt` failed: {type(exc).__name__}: {exc}") from exc
    rec.details["tensorrt_version"] = getattr(trt, "__version__", "?")
    head = _find_head(ctx)
    rec.details["head"], rec.details["target"] = str(head), str(ctx.args.target)
    with open(Path(ctx.args.target) / "config.json") as f:
        vocab = int(json.load(f).get("vocab_size", 2))
    failures: list[str] = []
    for variant in ("portable", "plugin"):
        entry: dict[str, Any] = {}
        rec.details[variant] = entry
        plugin_lib: Path | None = None
        if variant == "plugin":
            try:
                plugin_lib = Path(ctx.args.plugin_lib) if ctx.args.plugin_lib else _build_trt_plugin(ctx, rec)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"[:1000]
                failures.append(f"plugin: {entry['error'][:120]}")
                rec.save()
                continue
        out_dir = ctx.work_dir / f"engine_{variant}"
        cmd = [sys.executable, "-m", "export.cli", "--head", str(head), "--target", str(ctx.args.target)]
        cmd += ["--out", str(out_dir), "--variant", variant, "--engine", "--overwrite"]
        if plugin_lib is not None:
            cmd += ["--plugin-lib", str(plugin_lib)]
        cmd += list(ctx.args.export_arg)
        entry["cmd"] = " ".join(cmd)
        t0 = time.perf_counter()
        rc, out = run_killable(cmd, ctx.limit(ctx.args.export_timeout_s), cwd=REPO)
        entry.update(rc=rc, seconds=round(time.perf_counter() - t0, 1), output_tail=out[-3000:])
        rec.save()
        if rc != 0:
            failures.append(f"{variant}: export " + ("timed out" if rc is None else f"rc={rc}"))
            continue
        try:
            if plugin_lib is not None:
                trt.get_plugin_registry().load_library(str(plugin_lib))
            config = json.loads((out_dir / "config.json").read_text())
            engines = config.get("engines") or {}
            if not engines:
                raise RuntimeError("config.json lists no engines")
            entry["engines"] = {}
            for graph, file in engines.items():
                entry["engines"][graph] = _run_engine(trt, out_dir / file, vocab)
                rec.save()
            bad = [g for g, info in entry["engines"].items() if not all(info["finite_outputs"].values())]
            if bad:
                failures.append(f"{variant}: non-finite outputs from {bad}")
        except Exception as exc:
            entry["run_error"] = f"{type(exc).__name__}: {exc}"[:1000]
            failures.append(f"{variant}: engine run failed")
        rec.save()
    if failures:
        raise StepFailed("; ".join(failures))
    return "both variants exported, built and ran (finite outputs at the profile opt shapes)"


def step_pytest_gpu(ctx: Context, rec: Recorder) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider", "tests"]
    rec.details["cmd"] = " ".join(cmd)
    rc, out = run_killable(cmd, ctx.limit(ctx.args.pytest_timeout_s), cwd=REPO, env=env)
    rec.details.update(rc=rc, output_tail=out[-6000:])
    summary_lines = [
        ln
        for ln in out.splitlines()
        if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b.* in ", ln)
    ]
    last = summary_lines[-1] if summary_lines else ""
    counts = {
        kind: int(num) for num, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", last)
    }
    rec.details["counts"] = counts
    summary = ", ".join(f"{v} {k}" for k, v in counts.items()) or "no pytest summary line"
    if rc == 5:
        raise Skip(f"no tests selected by -m gpu ({summary})")
    if rc != 0:
        raise StepFailed(f"pytest {'timed out' if rc is None else f'rc={rc}'}: {summary}")
    return summary


STEPS = [
    Step("cuda_ext_build", step_cuda_ext_build, 200, "build/load the CUDA torch extension"),
    Step("cuda_ext_numerics", step_cuda_ext_numerics, 90, "CUDA extension vs reference"),
    Step("triton_numerics", step_triton_numerics, 180, "Triton kernel vs reference", cpu_smoke=True),
    Step("timing", step_timing, 180, "SDPA dense mask vs CUDA ext vs Triton", cpu_smoke=True),
    Step("pytest_gpu", step_pytest_gpu, 180, "pytest -m gpu"),
    Step(
        "tensorrt_engines",
        step_tensorrt_engines,
        420,
        "plugin CMake build, jetflow-export --engine, run engines",
    ),
]
STEP_NAMES = [s.name for s in STEPS]


# --------------------------------------------------------------------------------------------------
# orchestration
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="skip every GPU step (automatic without CUDA)")
    p.add_argument("--cpu-smoke", action="store_true", help="run the Triton steps on CPU (interpreter)")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--only", nargs="+", choices=STEP_NAMES, default=None, help="run only these steps")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall-clock budget for all steps")
    p.add_argument("--target", default=str(REPO / "data_gen/toy/assets/small"), help="target for the engines")
    p.add_argument("--head", default=None, help="draft head for the engines (default: the shipped toy head)")
    p.add_argument("--export-arg", action="append", default=[], help="extra argument for jetflow-export")
    p.add_argument(
        "--plugin-lib", default=None, help="prebuilt TreeAttention plugin .so (default: CMake-build it)"
    )
    p.add_argument("--export-timeout-s", type=float, default=140.0)
    p.add_argument("--pytest-timeout-s", type=float, default=170.0)
    # internal: run one step in this process
    p.add_argument("--run-step", choices=STEP_NAMES, help=argparse.SUPPRESS)
    p.add_argument("--step-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--deadline-epoch", type=float, default=None, help=argparse.SUPPRESS)
    return p


def run_step_here(args: argparse.Namespace) -> int:
    """Child-process entry: run one step, write its record to `--step-out`."""
    step = next(s for s in STEPS if s.name == args.run_step)
    previous = json.loads(args.state.read_text()) if args.state and args.state.exists() else {}
    device = "cpu" if args.cpu_smoke else "cuda"
    rec = Recorder(args.step_out)
    ctx = Context(args=args, device=device, previous=previous, work_dir=args.work_dir)
    t0 = time.perf_counter()
    try:
        summary = step.fn(ctx, rec)
        record = {"status": STATUS_PASSED, "summary": summary}
    except Skip as exc:
        record = {"status": STATUS_SKIPPED, "reason": str(exc)}
    except StepFailed as exc:
        record = {"status": STATUS_FAILED, "summary": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - anything a step raises is a recorded failure
        record = {
            "status": STATUS_FAILED,
            "summary": f"{type(exc).__name__}: {exc}"[:500],
            "traceback": traceback.format_exc()[-4000:],
        }
    record["seconds"] = round(time.perf_counter() - t0, 1)
    record["details"] = rec.details
    args.step_out.write_text(json.dumps(record, indent=1, default=str))
    return 0


def environment() -> dict[str, Any]:
    """Versions and the device, for the record (never fails)."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        env["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:
        env["git_commit"] = None
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available()
        if env["cuda_available"]:
            env["device_name"] = torch.cuda.get_device_name(0)
            env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as exc:
        env["torch"] = f"import failed: {exc}"
        env["cuda_available"] = False
    for mod in ("triton", "tensorrt"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:
            env[mod] = f"not importable ({type(exc).__name__})"
    env["nvcc"] = shutil.which("nvcc")
    return env


def _write(out: Path, payload: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    tmp.replace(out)


def _child_cmd(
    args: argparse.Namespace, step: Step, step_out: Path, state: Path, work_dir: Path
) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-step", step.name]
    cmd += ["--step-out", str(step_out), "--state", str(state), "--work-dir", str(work_dir)]
    cmd += ["--target", args.target, "--export-timeout-s", str(args.export_timeout_s)]
    cmd += ["--pytest-timeout-s", str(args.pytest_timeout_s)]
    if args.head:
        cmd += ["--head", args.head]
    if args.plugin_lib:
        cmd += ["--plugin-lib", args.plugin_lib]
    for extra in args.export_arg:
        cmd += [f"--export-arg={extra}"]
    if args.quick:
        cmd.append("--quick")
    if args.cpu_smoke:
        cmd.append("--cpu-smoke")
    return cmd


def run_all(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    args.out = args.out.resolve()  # step processes run from the repository root
    deadline = start + args.budget_s
    env = environment()
    dry_reason = None
    if args.dry_run:
        dry_reason = "--dry-run: GPU steps are not run"
    elif not env.get("cuda_available") and not args.cpu_smoke:
        dry_reason = "no CUDA device (torch.cuda.is_available() is False): ran as --dry-run"
    payload: dict[str, Any] = {
        "format": "jetflow-gpu-check",
        "format_version": 1,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dry_run": dry_reason is not None,
        "dry_run_reason": dry_reason,
        "cpu_smoke": bool(args.cpu_smoke),
        "environment": env,
        "steps": {},
    }
    results: dict[str, dict[str, Any]] = payload["steps"]
    work_dir = args.out.parent / "work"
    work_dir.mkdir(parents=True, exist_ok=True)
    # one extension cache for the build step and the steps that load the extension again
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str((work_dir / "torch_extensions").resolve()))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        state = Path(tmp) / "state.json"
        for step in STEPS:
            record: dict[str, Any]
            if args.only and step.name not in args.only:
                record = {"status": STATUS_SKIPPED, "reason": "not selected by --only"}
            elif dry_reason is not None:
                record = {"status": STATUS_SKIPPED, "reason": dry_reason}
            elif args.cpu_smoke and not step.cpu_smoke:
                record = {"status": STATUS_SKIPPED, "reason": "--cpu-smoke: needs a CUDA device"}
            elif deadline - time.perf_counter() < 10:
                record = {
                    "status": STATUS_SKIPPED,
                    "reason": f"time budget of {args.budget_s:.0f} s exhausted",
                }
            else:
                record = _run_child(args, step, Path(tmp), state, work_dir, deadline)
            record["what"] = step.what
            results[step.name] = record
            state.write_text(json.dumps(results, default=str))
            payload["elapsed_s"] = round(time.perf_counter() - start, 1)
            _write(args.out, payload)  # after every step: a killed run still leaves its results
            print(f"[gpu_check] {step.name}: {record['status']} ({record.get('seconds', 0)} s)", flush=True)
    failed = [n for n, r in results.items() if r["status"] == STATUS_FAILED]
    payload["ok"] = not failed
    _write(args.out, payload)
    print_tables(payload, args.out)
    return 1 if failed else 0


def _run_child(
    args: argparse.Namespace, step: Step, tmp: Path, state: Path, work_dir: Path, deadline: float
) -> dict[str, Any]:
    step_out = tmp / f"{step.name}.json"
    timeout = max(1.0, min(step.timeout_s, deadline - time.perf_counter()))
    cmd = _child_cmd(args, step, step_out, state, work_dir) + [f"--deadline-epoch={time.time() + timeout}"]
    t0 = time.perf_counter()
    rc, out = run_killable(cmd, timeout, cwd=REPO)
    why = f"timed out after {timeout:.0f} s" if rc is None else None
    seconds = round(time.perf_counter() - t0, 1)
    try:
        record = json.loads(step_out.read_text())
    except (OSError, ValueError):
        record = {}
    if record.get("partial") or not record:
        details = record.get("details", {})
        record = {
            "status": STATUS_FAILED,
            "summary": why or f"step process exited with rc={rc} before recording a result",
            "details": details,
        }
    record["seconds"] = seconds
    if record["status"] == STATUS_FAILED:
        record["process_output_tail"] = out[-4000:]
    return record


def print_tables(payload: dict[str, Any], out: Path) -> None:
    """Timing rows (if any), then the step table last."""
    timing = payload["steps"].get("timing", {}).get("details", {}).get("rows") or []
    if timing:
        impls = ["sdpa_dense", "cuda_ext", "triton"]
        print("\nlatency per call (ms)")
        print(f"{'shape':34} {'dtype':9} " + " ".join(f"{i:>10}" for i in impls))
        for row in timing:
            cells = []
            for i in impls:
                v = row.get(f"{i}_ms")
                cells.append(
                    f"{v:10.4f}"
                    if isinstance(v, int | float)
                    else f"{'-' if f'{i}_error' not in row else 'error':>10}"
                )
            print(f"{row['shape']:34} {row['dtype']:9} " + " ".join(cells))
    sweep = payload["steps"].get("timing", {}).get("details", {}).get("triton_sweep") or []
    for shape in dict.fromkeys(r["shape"] for r in sweep):
        timed = [r for r in sweep if r["shape"] == shape and "ms" in r]
        if timed:
            best = min(timed, key=lambda r: r["ms"])
            default = next((r["ms"] for r in timed if r["settings"] == "defaults"), None)
            print(f"triton sweep {shape}: best {best['settings']} {best['ms']} ms (defaults {default} ms)")
    print(f"\nstep               status   seconds  summary / reason   (full results: {out})")
    for name, rec in payload["steps"].items():
        text = rec.get("summary") or rec.get("reason") or ""
        print(f"{name:18} {rec['status']:8} {rec.get('seconds', 0):7}  {text[:100]}")
    verdict = (
        "DRY RUN (nothing ran on a GPU)" if payload["dry_run"] else ("OK" if payload.get("ok") else "FAILED")
    )
    print(f"overall: {verdict}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.run_step:
        return run_step_here(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
