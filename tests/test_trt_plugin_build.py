"""Build checks for the TensorRT `TreeAttention` plugin (trt_plugins/tree_attention) and its CUDA kernel.

1. The kernel compiles with nvcc to sm_80 and sm_90 object code, warning-free and without register
   spills, with every (dtype, head size) instantiation present. Needs only nvcc, so it runs on CPU-only CI.
2. Where TensorRT headers are found, CMake builds the plugin library and its smoke test runs: entry
   points, creator lookup, plugin creation, output count/types/shapes (plus numerics when a GPU exists),
   and the library must not depend on libnvinfer.
3. On a GPU (`pytest -m gpu`), the torch extension built on the same kernel matches
   `jetflow_pl.ops.tree_attention_reference`, shared masks and batches (per-request masks and prefix
   lengths) alike.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jetflow_pl.ops.tree_attention import packed_mask_to_dense, tree_attention_reference

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "trt_plugins" / "tree_attention"
KERNEL_SOURCE = PLUGIN_DIR / "tree_attention_kernel.cu"
N_INSTANTIATIONS = 6  # {float, half, bfloat16} x head size {64, 128}


def _find_nvcc() -> str | None:
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def _find_tensorrt_include() -> Path | None:
    """Directory holding NvInferRuntime.h: $TensorRT_ROOT/include, else the usual system include paths."""
    roots = []
    if os.environ.get("TensorRT_ROOT"):
        root = Path(os.environ["TensorRT_ROOT"])
        roots += [root / "include", root]
    roots += [Path(p) for p in os.environ.get("CPATH", "").split(os.pathsep) if p]
    roots += [
        Path("/usr/include/x86_64-linux-gnu"),
        Path("/usr/include/aarch64-linux-gnu"),
        Path("/usr/include"),
    ]
    roots += [Path("/usr/local/include"), Path("/usr/local/tensorrt/include"), Path("/opt/tensorrt/include")]
    return next((r for r in roots if (r / "NvInferRuntime.h").is_file()), None)


# --------------------------------------------------------------------------- 1. nvcc compiles the kernel


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernel_compiles_to_object_code(arch: str, tmp_path: Path) -> None:
    nvcc = _find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set NVCC or put nvcc on PATH)")
    obj = tmp_path / f"tree_attention_kernel_{arch}.o"
    cmd = [nvcc, "-std=c++17", "-O3", f"-arch={arch}", "-Werror", "all-warnings", "-Xptxas", "-v"]
    cmd += ["-c", str(KERNEL_SOURCE), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nvcc failed:\n{proc.stdout}\n{proc.stderr}"
    assert obj.is_file() and obj.stat().st_size > 0
    # ptxas -v lists every kernel it assembled for the target: all instantiations must be there.
    entries = re.findall(r"Compiling entry function '(\w+)' for '(\w+)'", proc.stdout + proc.stderr)
    kernels = {name for name, target in entries if target == arch and "treeAttentionKernel" in name}
    assert len(kernels) == N_INSTANTIATIONS, (
        f"expected {N_INSTANTIATIONS} kernels for {arch}, got {sorted(kernels)}"
    )
    # No instantiation keeps any of its state in local memory: ptxas reports zero spill bytes for each.
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", proc.stdout + proc.stderr)
    assert len(spills) >= N_INSTANTIATIONS and all(a == b == "0" for a, b in spills), spills
    # The host launcher the plugin and the torch extension call is defined in the object.
    nm = shutil.which("nm")
    if nm is not None:
        symbols = subprocess.run(
            [nm, "-C", "--defined-only", str(obj)], capture_output=True, text=True
        ).stdout
        assert "jetflow::launchTreeAttention(" in symbols


# --------------------------------------------------------------- 2. CMake build + smoke test (TensorRT)


def test_plugin_builds_and_smoke_test_passes(tmp_path: Path) -> None:
    include = _find_tensorrt_include()
    if include is None:
        pytest.skip("TensorRT headers not found (set TensorRT_ROOT)")
    cmake, nvcc = shutil.which("cmake"), _find_nvcc()
    if cmake is None or nvcc is None:
        pytest.skip("cmake and nvcc are needed to build the plugin")
    build = tmp_path / "build"
    configure = [cmake, "-S", str(PLUGIN_DIR), "-B", str(build), f"-DTensorRT_ROOT={include.parent}"]
    configure += [f"-DTensorRT_INCLUDE_DIR={include}", f"-DCMAKE_CUDA_COMPILER={nvcc}"]
    for cmd in (configure, [cmake, "--build", str(build), "-j", "2"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    library = build / "libjetflow_trt_plugins.so"
    readelf = shutil.which("readelf")
    if readelf is not None:  # TensorRT resolves the plugin through its entry points, not through libnvinfer
        dynamic = subprocess.run([readelf, "-d", str(library)], capture_output=True, text=True).stdout
        assert "libnvinfer" not in dynamic, dynamic
        exported = subprocess.run(
            [readelf, "--dyn-syms", "-W", str(library)], capture_output=True, text=True
        ).stdout
        for symbol in ("getCreators", "setLoggerFinder"):
            assert re.search(rf"GLOBAL\s+DEFAULT\s+\d+\s+{symbol}$", exported, re.M), f"{symbol} not exported"

    smoke = subprocess.run(
        [str(build / "tree_attention_smoke_test"), str(library)], capture_output=True, text=True, timeout=300
    )
    assert smoke.returncode == 0 and smoke.stdout.strip().endswith("PASS"), smoke.stdout + smoke.stderr


# ------------------------------------------------------ 3. torch extension vs the reference (GPU only)


def _load_torch_ext():
    spec = importlib.util.spec_from_file_location(
        "jetflow_tree_attention_torch_ext", PLUGIN_DIR / "torch_ext" / "__init__.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _pack(dense: torch.Tensor, words: int) -> torch.Tensor:
    """bool [N, N] -> int32 [N, words]: bit b of word w <=> column 32w + b (LSB first, bit 31 negative)."""
    n = dense.shape[0]
    bits = torch.zeros(n, words * 32, dtype=torch.int64)
    bits[:, :n] = dense.to(torch.int64)
    packed = (bits.view(n, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _tree_mask(n: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self visibility [N, N] of a random forest ("tree") or a chain ("causal")."""
    dense = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        if kind == "causal":
            dense[i] = dense[i - 1]
            dense[i, i] = True
        else:
            parent = int(torch.randint(-1, i, (1,), generator=gen))  # -1: a new root (forest)
            if parent >= 0:
                dense[i] = dense[parent]
                dense[i, i] = True
    return dense


# (B, Hq, Hkv, N, P, d, mask kind, extra mask words with garbage bits past N)
CASES = [
    (1, 4, 4, 5, 0, 64, "tree", 0),  # P = 0, one partial tile, MHA
    (2, 8, 2, 40, 17, 64, "tree", 0),  # GQA, N > 32 (two words), partial prefix tile
    (1, 2, 2, 33, 0, 128, "tree", 1),  # P = 0, N = 33, padded mask rows with junk
    (1, 4, 1, 256, 300, 128, "tree", 0),  # N = 256 (8 words), long prefix, MQA
    (1, 4, 2, 256, 0, 64, "causal", 0),  # prefill: chain mask, P = 0
    (2, 16, 4, 63, 1000, 128, "tree", 0),  # many prefix tiles
]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-Hq{}-Hkv{}-N{}-P{}-d{}-{}-pad{}".format(*c))
def test_torch_extension_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    b, hq, hkv, n, p, d, kind, pad = case
    gen = torch.Generator().manual_seed(1234 + n + p)
    dense = _tree_mask(n, kind, gen)
    words = (n + 31) // 32 + pad
    mask = _pack(dense, words)
    if pad or n % 32:
        # junk bits past N must be ignored by both implementations
        junk = torch.randint(-(2**31), 2**31 - 1, mask.shape, generator=gen, dtype=torch.int64).to(
            torch.int32
        )
        keep = _pack(torch.ones(n, n, dtype=torch.bool), words)
        mask = (mask & keep) | (junk & ~keep)
    assert torch.equal(packed_mask_to_dense(mask, n), dense)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    q, k, v = rand(b, hq, n, d), rand(b, hkv, n, d), rand(b, hkv, n, d)
    pk, pv = rand(b, hkv, p, d), rand(b, hkv, p, d)
    scale = d**-0.5
    want = tree_attention_reference(
        *(t.float() for t in (q, pk, pv, k, v)), mask, scale
    )  # fp32 on the same (rounded) inputs
    ext = _load_torch_ext()
    cuda = [t.cuda() for t in (q, pk, pv, k, v, mask)]
    got = ext.tree_attention_cuda(*cuda, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float().cpu(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# (Hq, Hkv, tree sizes per request, past lengths per request, padded prefix P, d)
BATCHED_CASES = [
    (4, 2, (40, 5, 1), (17, 0, 33), 40, 64),  # two-word and one-word trees, a request with no prefix
    (8, 2, (256, 70, 129, 3), (300, 0, 1000, 31), 1024, 128),  # N = 256 (8 words), long ragged prefixes
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", BATCHED_CASES, ids=lambda c: "Hq{}-Hkv{}-n{}-p{}-P{}-d{}".format(*c))
def test_torch_extension_batched_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    """Per-request [B, N, W] masks and past_lengths; NaN in every padding prefix row must not leak."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    from jetflow_pl.masks import pack_mask_batch

    hq, hkv, sizes, lengths, p, d = case
    gen = torch.Generator().manual_seed(sum(sizes) + p)
    mask, _ = pack_mask_batch([_tree_mask(n, "tree", gen) for n in sizes])
    b, n = mask.shape[0], mask.shape[1]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    q, k, v = rand(b, hq, n, d), rand(b, hkv, n, d), rand(b, hkv, n, d)
    pk, pv = rand(b, hkv, p, d), rand(b, hkv, p, d)
    for i, length in enumerate(lengths):
        pk[i, :, length:] = float("nan")
        pv[i, :, length:] = float("nan")
    past_lengths = torch.tensor(lengths, dtype=torch.int32)
    scale = d**-0.5
    want = tree_attention_reference(*(t.float() for t in (q, pk, pv, k, v)), mask, scale, past_lengths)
    ext = _load_torch_ext()
    got = ext.tree_attention_cuda(*(t.cuda() for t in (q, pk, pv, k, v, mask)), scale, past_lengths.cuda())
    assert got.dtype == dtype and got.shape == q.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got.float().cpu(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
