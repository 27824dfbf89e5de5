"""A Triton kernel for the `jetflow::tree_attention` contract (see `tree_attention.py` for the semantics).

Why a Triton kernel next to the CUDA plugin: it is the quickest way to run the exact contract on a GPU
from Python (benchmarks, the torch backend), and under `TRITON_INTERPRET=1` the very same kernel source
runs on CPU tensors, so its indexing and masking are tested on machines without a GPU.

Design (one program = one tile of BLOCK_M query rows of one (batch row, KV head), one KV split):

* GQA packing: the `group = Hq / Hkv` query heads that share a KV head are stacked along the row axis
  (row r -> query head `hkv * group + r // N`, node `r % N`), so each K/V tile is loaded once per group
  instead of once per query head.
* Two passes over keys with one online softmax (fp32 running max / sum / accumulator, base-2 exponent
  with `scale * log2(e)` folded into the logits): the prefix `past_*` (every row visible, only bounds
  masking; with `past_lengths` the loop stops at request b's length, so padding rows are never loaded)
  and then the tree keys, whose visibility bits are read straight from the packed int32 mask (request
  b's mask, or the shared one through a batch stride of 0; row i, word j // 32, bit j % 32) - no dense
  mask is ever built.
* Tree tiles whose visibility bits are all zero for the current rows are skipped (for ancestor masks
  that is every tile above the diagonal).
* A row that sees nothing (P = 0 and an empty mask row; never the case for a tree, whose rows see
  themselves) returns zeros, as the reference does.
* Flash-decoding KV splits: when a call has fewer programs than about two per SM (few tree rows, long
  prefix), the prefix is cut into splits run by separate programs (split 0 also takes the tree keys);
  each writes its unnormalised (max, sum, accumulator) and `_combine_kernel` merges them.
* fp32 inputs use `input_precision="ieee"` by default (no TF32), so fp32 results match the reference to
  ~1e-6; fp16/bf16 inputs use tensor cores with fp32 accumulation (probabilities are cast to the value
  dtype before the P @ V product, the usual flash-attention trade-off).

Triton is optional: it is imported on the first call. `TRITON_INTERPRET` is read by `triton.jit` when
the kernel is wrapped, which here happens lazily and separately per mode, so setting the variable any
time before the first call in a process is enough.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from jetflow_pl.ops.contract import check_inputs

__all__ = ["is_triton_available", "tree_attention_triton"]

_LOG2E = 1.4426950408889634

# Filled by `_load_triton()`. The kernel body below resolves `tl` from this module's globals (the
# interpreter also looks for it there), so it must be a module global, not a local import.
triton: Any = None
tl: Any = None
_KERNELS: dict[tuple[str, bool], Any] = {}
_SM_COUNT: dict[int, int] = {}


def is_triton_available() -> bool:
    """True when `import triton` works (it does not say whether a GPU is present)."""
    try:
        _load_triton()
    except ImportError:
        return False
    return True


def _load_triton() -> None:
    global triton, tl
    if tl is not None:
        return
    try:
        import triton as _triton
        import triton.language as _tl
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "tree_attention_triton needs the `triton` package (pip install triton; on CPU-only machines "
            "run it with TRITON_INTERPRET=1). Use jetflow_pl.ops.tree_attention.tree_attention_reference "
            f"instead where triton is unavailable. Original error: {exc}"
        ) from exc
    triton, tl = _triton, _tl


def _interpret_mode() -> bool:
    """Whether `triton.jit` would build an interpreted kernel now (triton's own knob, else the env var)."""
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older triton without `knobs`
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _kernels() -> tuple[Any, Any]:
    """The jitted (attention, combine) kernels for the current mode (compiled vs interpreted).

    Wrapped on first use: `triton.jit` picks InterpretedFunction vs JITFunction from
    `knobs.runtime.interpret`, which reads TRITON_INTERPRET at that moment.
    """
    _load_triton()
    interpret = _interpret_mode()
    for name, fn in (("attention", _tree_attention_kernel), ("combine", _combine_kernel)):
        if (name, interpret) not in _KERNELS:
            _KERNELS[(name, interpret)] = triton.jit(fn)
    return _KERNELS[("attention", interpret)], _KERNELS[("combine", interpret)]


def _tree_attention_kernel(
    Q,
    PK,
    PV,
    K,
    V,
    MASK,
    PAST_LEN,
    OUT,
    PART_ACC,
    PART_M,
    PART_L,
    sq_b,
    sq_h,
    sq_n,
    sq_d,
    spk_b,
    spk_h,
    spk_p,
    spk_d,
    spv_b,
    spv_h,
    spv_p,
    spv_d,
    sk_b,
    sk_h,
    sk_n,
    sk_d,
    sv_b,
    sv_h,
    sv_n,
    sv_d,
    so_b,
    so_h,
    so_n,
    so_d,
    sm_b,
    sm_n,
    sm_w,
    N,
    P,
    D,
    HKV,
    qk_scale,
    kv_per_split,
    total_rows,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_PAST_LEN: tl.constexpr,
):
    """Kernel body (wrapped by `triton.jit` lazily in `_kernel`); see the module docstring.

    Only `triton.language` builtins are called here, and reductions go through `tl.reduce` with
    triton's own max / sum combiners: the jit-defined helpers (`tl.max`, `tl.sum`, `tl.zeros`) are
    built in the mode that was active when triton was first imported, so calling them would tie the
    interpreter to `TRITON_INTERPRET` being set before any `import triton` in the process, while
    `tl.reduce` with these combiners takes the interpreter's numpy fast path in either case.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)  # KV split (flash-decoding); always 0 unless SPLIT
    b = pid_bh // HKV
    hkv = pid_bh % HKV

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (query head in group, node) rows
    row_ok = rows < GROUP * N
    node = rows % N
    hq = hkv * GROUP + rows // N
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    q_ptrs = Q + b * sq_b + hq[:, None] * sq_h + node[:, None] * sq_n + offs_d[None, :] * sq_d
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)

    # ---- pass 1: this split's slice of the request's valid prefix, visible from every row ----------
    if HAS_PAST_LEN:  # rows at or past past_lengths[b] are padding: never loaded
        p_valid = tl.minimum(tl.maximum(tl.load(PAST_LEN + b), 0), P)
    else:
        p_valid = P
    pk_base = PK + b * spk_b + hkv * spk_h
    pv_base = PV + b * spv_b + hkv * spv_h
    lo = pid_s * kv_per_split
    hi = tl.minimum(lo + kv_per_split, p_valid)  # kv_per_split is a multiple of BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        kt = tl.load(
            pk_base + cols[None, :] * spk_p + offs_d[:, None] * spk_d,
            mask=d_ok[:, None] & col_ok[None, :],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, kt, input_precision=INPUT_PRECISION) * qk_scale
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        v = tl.load(
            pv_base + cols[:, None] * spv_p + offs_d[None, :] * spv_d,
            mask=col_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    # ---- pass 2: the tree keys, visible where the packed mask bit is set (split 0) --------------------------
    if pid_s == 0:
        k_base = K + b * sk_b + hkv * sk_h
        v_base = V + b * sv_b + hkv * sv_h
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            words = tl.load(
                MASK + b * sm_b + node[:, None] * sm_n + (cols // 32)[None, :] * sm_w,
                mask=row_ok[:, None] & col_ok[None, :],
                other=0,
            )
            visible = ((words >> (cols % 32)[None, :]) & 1) != 0  # arithmetic shift is fine: we keep bit 0
            any_row = tl.reduce(visible.to(tl.int32), 1, tl.standard._elementwise_max)
            if tl.reduce(any_row, 0, tl.standard._elementwise_max) > 0:
                kt = tl.load(
                    k_base + cols[None, :] * sk_n + offs_d[:, None] * sk_d,
                    mask=d_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )
                s = tl.dot(q, kt, input_precision=INPUT_PRECISION) * qk_scale
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
                v = tl.load(
                    v_base + cols[:, None] * sv_n + offs_d[None, :] * sv_d,
                    mask=col_ok[:, None] & d_ok[None, :],
                    other=0.0,
                )
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
                m_i = m_new

    if SPLIT:  # unnormalised partial results; `_combine_kernel` merges the splits
        part = pid_s * total_rows + (b * (HKV * GROUP) + hq) * N + node
        tl.store(PART_M + part, m_i, mask=row_ok)
        tl.store(PART_L + part, l_i, mask=row_ok)
        tl.store(PART_ACC + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows that saw nothing: acc is 0 -> 0
        o_ptrs = OUT + b * so_b + hq[:, None] * so_h + node[:, None] * so_n + offs_d[None, :] * so_d
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _combine_kernel(
    PART_ACC,
    PART_M,
    PART_L,
    OUT,
    so_b,
    so_h,
    so_n,
    so_d,
    total_rows,
    N,
    HQ,
    D,
    num_splits,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge the per-split (max, sum, accumulator) triples of `_tree_attention_kernel` into the output.

    Rows are flattened `(b, query head, node)`; the same log-sum-exp rescaling as the online softmax.
    """
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < total_rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_sum = tl.full([BLOCK_R], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_R, BLOCK_D], 0.0, dtype=tl.float32)
    for split in range(0, num_splits):
        part = split * total_rows + r
        m_s = tl.load(PART_M + part, mask=r_ok, other=float("-inf"))
        l_s = tl.load(PART_L + part, mask=r_ok, other=0.0)
        a_s = tl.load(PART_ACC + part[:, None] * BLOCK_D + offs_d[None, :], mask=r_ok[:, None], other=0.0)
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        beta = tl.exp2(m_s - m_safe)
        l_sum = l_sum * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m = m_new
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    node = r % N
    bh = r // N
    o_ptrs = OUT + (bh // HQ) * so_b + (bh % HQ) * so_h + node * so_n
    o_ptrs = o_ptrs[:, None] + offs_d[None, :] * so_d
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _default_blocks(rows: int, head_dim_block: int, dtype: torch.dtype, interpret: bool) -> tuple[int, int]:
    """Tile sizes. Compiled: 64x64 (64x32 for fp32 with d > 64, to keep the fp32 tiles in registers).

    Interpreted: larger tiles, because the interpreter's cost is per Triton op, not per element.
    """
    if interpret:
        block_m = min(128, max(16, _next_pow2(rows)))
        return block_m, 128
    block_m = 64 if rows > 32 else max(16, _next_pow2(rows))
    block_n = 32 if (dtype == torch.float32 and head_dim_block > 64) else 64
    return block_m, block_n


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _auto_splits(programs: int, p: int, block_n: int, device: torch.device, interpret: bool) -> int:
    """How many KV splits (flash-decoding) the prefix gets.

    Decode-shaped calls (few tree rows, long prefix) launch fewer programs than the GPU has SMs; the
    prefix is then cut into splits of at least 4 tiles until there are about two programs per SM.
    The interpreter never splits by default (it runs programs one after another anyway).
    """
    if interpret or device.type != "cuda" or p < 8 * block_n:
        return 1
    target = 2 * _sm_count(device)
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), p // (4 * block_n), 64))


def tree_attention_triton(
    query: Tensor,
    past_key: Tensor,
    past_value: Tensor,
    key: Tensor,
    value: Tensor,
    packed_mask: Tensor,
    scale: float,
    past_lengths: Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    input_precision: str = "ieee",
    num_warps: int = 4,
    num_stages: int = 2,
) -> Tensor:
    """`jetflow::tree_attention` with the Triton kernel; same arguments and result as the reference
    (`packed_mask` `[N, W]` shared or `[B, N, W]` per request, `past_lengths` int32 `[B]` or None).

    Keyword-only knobs (tests and benchmarks): `block_m` / `block_n` tile sizes (powers of two >= 16),
    `num_splits` KV splits of the prefix (None: automatic, 1: none), `input_precision` for fp32 inputs
    ("ieee" exact, "tf32" faster), `num_warps` / `num_stages` for the compiled kernel (ignored by the
    interpreter).

    Tensors must be CUDA tensors for the compiled kernel, or any tensors with `TRITON_INTERPRET=1`.
    Key/value tensors of another dtype than `query` are cast to it (as the reference does for the
    prefix). Arbitrary strides are supported (no copies), e.g. K/V views into a larger cache.
    """
    kernel, combine = _kernels()  # raises the ImportError first when triton is missing
    interpret = _interpret_mode()
    check_inputs(query, past_key, past_value, key, value, packed_mask, past_lengths)
    b, hq, n, d = query.shape
    hkv, p = key.shape[1], past_key.shape[2]
    if key.shape[0] != b or key.shape[2] != n or key.shape[3] != d:
        raise ValueError(f"key shape {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if past_key.shape[0] != b or past_key.shape[1] != hkv or past_key.shape[3] != d:
        raise ValueError(f"past_key shape {tuple(past_key.shape)} does not match key {tuple(key.shape)}")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"query dtype must be float32, float16 or bfloat16, got {query.dtype}")

    dtype, device = query.dtype, query.device
    key, value = key.to(dtype), value.to(dtype)
    past_key, past_value = past_key.to(dtype), past_value.to(dtype)
    if p == 0:  # never read; avoids handing the launcher a null pointer of an empty tensor
        past_key, past_value = key, value
    mask = packed_mask.to(device)
    mask_b_stride = mask.stride(0) if mask.dim() == 3 else 0  # a 2-D mask is shared by the batch
    has_past_len = past_lengths is not None
    lengths = past_lengths.to(device).contiguous() if has_past_len else mask  # never read without them
    out = torch.empty_like(query)
    if out.numel() == 0:
        return out

    group = hq // hkv
    block_d = max(16, _next_pow2(d))
    auto_m, auto_n = _default_blocks(group * n, block_d, dtype, interpret)
    block_m = block_m or auto_m
    block_n = block_n or auto_n
    m_tiles = triton.cdiv(group * n, block_m)
    if num_splits is None:
        num_splits = _auto_splits(m_tiles * b * hkv, p, block_n, device, interpret)
    # every split but the last gets a whole number of tiles; empty trailing splits are dropped
    kv_per_split = triton.cdiv(triton.cdiv(p, max(1, num_splits)), block_n) * block_n
    num_splits = max(1, triton.cdiv(p, kv_per_split)) if p else 1
    split = num_splits > 1
    total_rows = b * hq * n
    if split:
        part_acc = torch.empty(num_splits, total_rows, block_d, dtype=torch.float32, device=device)
        part_m = torch.empty(num_splits, total_rows, dtype=torch.float32, device=device)
        part_l = torch.empty_like(part_m)
    else:  # never touched (SPLIT is a compile-time False)
        part_acc = part_m = part_l = out
    kernel[(m_tiles, b * hkv, num_splits)](
        query,
        past_key,
        past_value,
        key,
        value,
        mask,
        lengths,
        out,
        part_acc,
        part_m,
        part_l,
        *query.stride(),
        *past_key.stride(),
        *past_value.stride(),
        *key.stride(),
        *value.stride(),
        *out.stride(),
        mask_b_stride,
        *mask.stride()[-2:],
        n,
        p,
        d,
        hkv,
        float(scale) * _LOG2E,
        kv_per_split,
        total_rows,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        INPUT_PRECISION=input_precision,
        SPLIT=split,
        HAS_PAST_LEN=has_past_len,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        block_r = 64 if interpret or block_d <= 64 else 32
        combine[(triton.cdiv(total_rows, block_r),)](
            part_acc,
            part_m,
            part_l,
            out,
            *out.stride(),
            total_rows,
            n,
            hq,
            d,
            num_splits,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
