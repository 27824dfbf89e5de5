"""`jetflow::tree_attention`: the one tree-causal attention contract (torch, ONNX, TensorRT, Triton, CUDA).

Semantics (docs/DESIGN.md sections 4-5). Per request `b` and query head `h` (KV head `h // (Hq / Hkv)`, GQA):

    out[b, h, i] = softmax_j(scale * q[b, h, i] . K[b, j]) V[b, j]   over
        j in {prefix rows p < past_lengths[b]} U {tree rows t : bit t of packed_mask[b, i] is set}

and `out[b, h, i] = 0` when that set is empty. Requests never see each other.

With a sliding `window > 0` (a target's sliding-window layers: Gemma 3, Mistral), row `i` also loses every
key at or past its window: with `pos(i) = past_len[b] + depth(i)`, `depth(i)` = (bits set in row `i`) - 1
(a row sees its ancestors-or-self, so its popcount is its depth + 1), prefix row `p` at position `p` and tree
row `t` at `past_len[b] + depth(t)`, a key at position `k` stays visible iff `pos(i) - k < window`
(transformers' `sliding_window_overlay`). The positions are implied by the mask, as TensorRT-LLM's
`position_offsets` are the tree depths, so the window needs no input of its own: it is an attribute.

Arguments (positional order is the ONNX node's and the TensorRT plugin's input order):
    query         [B, Hq,  N, d]  fp32 / fp16 / bf16; the new rows (tree nodes, draft-block rows, a chain)
    past_key      [B, Hkv, P, d]  the KV prefix, P >= 0 rows per request (P may be 0)
    past_value    [B, Hkv, P, d]
    key, value    [B, Hkv, N, d]  K/V of the new rows themselves
    packed_mask   int32 [N, W] (one mask shared by the batch) or [B, N, W] (one per request),
                  W >= ceil(N / 32): the TensorRT-LLM packed layout, row i, word w, bit b (LSB first)
                  set iff new row 32w+b is visible from row i (ancestor-or-self). Bits at or past N are
                  ignored.
    scale         the softmax scale (usually d ** -0.5)
    past_lengths  optional int32 [B]: request b's prefix is rows [0, past_lengths[b]) of past_key /
                  past_value; rows at or past it are padding, never read (NaN there cannot leak). Values
                  are clamped to [0, P]. None (the batch-1 form): all P rows are visible.
    window        int >= 0: the sliding window (0: none, a global layer); see above
    returns       [B, Hq, N, d], the query's dtype.

Padding of a batch (requests with fewer than N nodes, TensorRT-LLM's generation lengths): rows past a
request's generation length have empty mask rows (`jetflow_pl.masks.pack_tree_batch`) and no valid row
sets their bits, so they are invisible to the request's real rows; their own output is attention over the
request's valid prefix alone, or 0 when `past_lengths[b] == 0`. Always finite for finite visible K/V.

The same contract is the ONNX node `jetflow::TreeAttention` (`export/tree_attention_onnx.py`; 6 inputs,
or 7 with `past_lengths`), the TensorRT plugin `TreeAttention` (`trt_plugins/`), the Triton kernel
(`triton_tree_attention.py`) and the CUDA kernel. `tree_attention_reference` is written with
export-friendly ops only (integer division against constant powers of two, no bitwise ops, no
data-dependent shapes), so the same function is the body of the `portable` ONNX graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from jetflow_pl.ops.contract import WORD_BITS, check_inputs


def _bit_values(device: torch.device) -> Tensor:
    """int64 `[32]`: `2 ** b`."""
    return torch.tensor([1 << b for b in range(WORD_BITS)], dtype=torch.int64, device=device)


def packed_mask_to_dense(packed_mask: Tensor, n: int | torch.SymInt | None = None) -> Tensor:
    """int32 `[..., W]` -> bool `[..., n]` (n defaults to the size of dim -2, i.e. a square tree mask).

    Plain integer arithmetic (bit b of the unsigned word u is `u // 2**b - 2 * (u // 2**(b+1))`), not
    bitwise ops: it exports to ONNX Div/Sub/Cast that every runtime and TensorRT's parser accept
    (TensorRT's ONNX parser only takes BitwiseAnd on bools), and traces with symbolic sizes. Leading axes
    are kept, so a batch of masks `[B, N, W]` unpacks to `[B, N, n]`.
    """
    if packed_mask.dtype != torch.int32:
        raise ValueError(f"packed_mask must be int32, got {packed_mask.dtype}")
    if n is None:
        n = packed_mask.shape[-2]
    words = packed_mask.to(torch.int64)
    words = torch.where(words < 0, words + 2**32, words).unsqueeze(-1)  # unsigned value of each word
    power = _bit_values(packed_mask.device)
    bits = torch.floor_divide(words, power) - 2 * torch.floor_divide(words, 2 * power)
    return (bits != 0).flatten(-2)[..., :n]


def prefix_valid(past_lengths: Tensor, num_past: int | torch.SymInt) -> Tensor:
    """bool `[B, P]`: prefix row `p` of request `b` is valid iff `p < past_lengths[b]` (Range + Less)."""
    rows = torch.arange(num_past, dtype=torch.int64, device=past_lengths.device)
    return rows.unsqueeze(0) < past_lengths.to(torch.int64).unsqueeze(1)


def window_visibility(
    tree_visible: Tensor, num_past: int | torch.SymInt, past_lengths: Tensor | None, window: int
) -> tuple[Tensor, Tensor]:
    """bool (prefix `[B or 1, N, P]`, tree `[B or 1, N, N]`): which keys lie inside each row's sliding
    `window` (module docstring), from the dense tree visibility `[N, N]` or `[B, N, N]` alone."""
    if tree_visible.dim() == 2:
        tree_visible = tree_visible.unsqueeze(0)
    depth = tree_visible.to(torch.int64).sum(dim=-1) - 1  # [B or 1, N]
    if past_lengths is None:
        past = depth.new_zeros(1, 1) + num_past
    else:
        past = past_lengths.to(torch.int64).unsqueeze(1)  # [B, 1]
    query_pos = past + depth  # [B or 1, N]
    prefix_pos = torch.arange(num_past, dtype=torch.int64, device=tree_visible.device)
    prefix_ok = (query_pos.unsqueeze(-1) - prefix_pos) < window
    tree_ok = (depth.unsqueeze(-1) - depth.unsqueeze(-2)) < window
    return prefix_ok, tree_ok


def tree_attention_parts(
    query: Tensor,
    past_key: Tensor,
    past_value: Tensor,
    key: Tensor,
    value: Tensor,
    packed_mask: Tensor,
    past_lengths: Tensor | None = None,
    window: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """The contract as dense attention inputs: K `[B,Hkv,P+N,d]`, V, visibility bool.

    Visibility is `[N, P+N]` (shared by the batch: a 2-D mask and no `past_lengths`, the batch-1 graphs
    stay as they were) or `[B, 1, N, P+N]` (per request; broadcast over heads). Padding prefix rows are
    replaced by zeros in K and V, so whatever they hold (NaN included) cannot reach a valid row through
    `0 * NaN` in the softmax-weighted sum.
    """
    check_inputs(query, past_key, past_value, key, value, packed_mask, past_lengths)
    n, p = query.shape[2], past_key.shape[2]
    past_key, past_value = past_key.to(query.dtype), past_value.to(query.dtype)
    tree_visible = packed_mask_to_dense(packed_mask, n)  # [N, N] or [B, N, N]
    if past_lengths is None:
        prefix_visible = torch.ones_like(tree_visible[..., :1]).expand(*tree_visible.shape[:-1], p)
    else:
        valid = prefix_valid(past_lengths, p)  # [B, P]
        keep = valid[:, None, :, None]
        past_key = torch.where(keep, past_key, torch.zeros_like(past_key))
        past_value = torch.where(keep, past_value, torch.zeros_like(past_value))
        if tree_visible.dim() == 2:
            tree_visible = tree_visible.unsqueeze(0).expand(query.shape[0], n, n)
        prefix_visible = valid.unsqueeze(1).expand(query.shape[0], n, p)
    if window > 0:
        prefix_ok, tree_ok = window_visibility(tree_visible, p, past_lengths, window)
        if prefix_visible.dim() == 2:  # keep the batch-1 form 2-D
            prefix_ok, tree_ok = prefix_ok[0], tree_ok[0]
        prefix_visible, tree_visible = prefix_visible & prefix_ok, tree_visible & tree_ok
    visible = torch.cat([prefix_visible, tree_visible], dim=-1)
    if visible.dim() == 3:
        visible = visible.unsqueeze(1)  # [B, 1, N, P+N]
    keys = torch.cat([past_key, key], dim=2)
    values = torch.cat([past_value, value], dim=2)
    return keys, values, visible


def _zero_empty_rows(out: Tensor, visible: Tensor) -> Tensor:
    """Rows that see nothing are 0 (eager SDPA already gives 0; exported softmaxes may average or NaN)."""
    seen = visible.any(dim=-1, keepdim=True)  # [N, 1] or [B, 1, N, 1]
    return torch.where(seen, out, torch.zeros_like(out))


def dense_attention(query: Tensor, keys: Tensor, values: Tensor, visible: Tensor, scale: float) -> Tensor:
    """SDPA over `[B,Hkv,S,d]` K/V (GQA expanded here) with a bool visibility mask `[N, S]` or
    `[B, 1, N, S]`."""
    b, hq, _, d = query.shape
    hkv = keys.shape[1]
    group = hq // hkv
    if group > 1:  # GQA: expand + reshape (exports as Expand/Reshape; no repeat_interleave)
        total = keys.shape[2]
        keys = keys[:, :, None].expand(b, hkv, group, total, d).reshape(b, hq, total, d)
        values = values[:, :, None].expand(b, hkv, group, total, d).reshape(b, hq, total, d)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scale)


def tree_attention_reference(
    query: Tensor,
    past_key: Tensor,
    past_value: Tensor,
    key: Tensor,
    value: Tensor,
    packed_mask: Tensor,
    scale: float,
    past_lengths: Tensor | None = None,
    window: int = 0,
) -> Tensor:
    """Reference implementation (SDPA with a dense boolean mask); see the module docstring."""
    keys, values, visible = tree_attention_parts(
        query, past_key, past_value, key, value, packed_mask, past_lengths, window
    )
    return _zero_empty_rows(dense_attention(query, keys, values, visible, scale), visible)


def tree_attention_grouped(
    query: Tensor,
    past_key: Tensor,
    past_value: Tensor,
    key: Tensor,
    value: Tensor,
    packed_mask: Tensor,
    scale: float,
    past_lengths: Tensor | None = None,
    window: int = 0,
) -> Tensor:
    """The contract as the `portable` graphs compute it: the reference's result, written so an exported
    graph moves each KV row as few times as it can.

    Why not the reference's form: exported, it copies the whole KV prefix four more times per layer than
    the attention reads it, and at 16 requests those copies, not the arithmetic, were the round (ONNX
    Runtime, SmolLM2, 2 cores, KV 256: 437 ms per AR step, of which Where 86, Concat 83, Transpose 68,
    Expand 54 ms against 109 ms of MatMul), so a round's cost grew with the KV length far faster than its
    arithmetic does. Here the query heads of one KV head are stacked as rows (`[B, Hkv, G*N, d]`), so K
    and V are read per KV head and never expanded for GQA; prefix and tree scores are two products,
    concatenated as scores (`G*N` x `P+N` numbers, not K/V rows), and the output is the sum of the two
    weighted products, so K/V prefix and tree rows are never concatenated either. Padding prefix rows:
    their scores are replaced (`Where` on the scores, so a NaN key cannot leak) and their values zeroed
    (a zero weight times a NaN value would still be NaN). Rows that see nothing are 0, as in the reference.
    Same numbers as `tree_attention_reference` up to summation order (tests/test_tree_attention_batched.py,
    which also checks that its export copies no cache tensor).
    """
    check_inputs(query, past_key, past_value, key, value, packed_mask, past_lengths)
    b, hq, n, d = query.shape
    p, hkv = past_key.shape[2], key.shape[1]
    group = hq // hkv
    past_key, past_value = past_key.to(query.dtype), past_value.to(query.dtype)
    q = query.reshape(b, hkv, group * n, d)  # query head h = kv head h // group, row (h % group) * n + i
    tree_visible = packed_mask_to_dense(packed_mask, n)  # [N, N] or [B, N, N]
    if tree_visible.dim() == 2:
        tree_visible = tree_visible.unsqueeze(0)
    window_prefix = None
    if window > 0:  # [B or 1, N, P] / [B or 1, N, N]
        window_prefix, window_tree = window_visibility(tree_visible, p, past_lengths, window)
        tree_visible = tree_visible & window_tree
    # [B or 1, 1, G*N, N]: every query head of a KV head sees the request's tree rows alike
    tree_visible = tree_visible[:, None, None].expand(-1, 1, group, n, n).reshape(-1, 1, group * n, n)
    if past_lengths is None:  # every prefix row is visible
        prefix_visible = torch.ones_like(tree_visible[..., :1]).expand(-1, 1, group * n, p)
    else:
        valid = prefix_valid(past_lengths, p)  # [B, P]
        prefix_visible = valid[:, None, None, :].expand(-1, 1, group * n, p)
        past_value = torch.where(
            valid[:, None, :, None], past_value, torch.zeros_like(past_value[:1, :1, :1])
        )
        if tree_visible.shape[0] != b:  # one mask shared by the batch
            tree_visible = tree_visible.expand(b, 1, group * n, n)
    if window_prefix is not None:  # [B or 1, 1, G*N, P]
        rows = window_prefix.shape[0]  # explicit: with an empty prefix (P = 0) a -1 would be ambiguous
        window_prefix = (
            window_prefix[:, None, None].expand(rows, 1, group, n, p).reshape(rows, 1, group * n, p)
        )
        prefix_visible = prefix_visible & window_prefix
        if prefix_visible.shape[0] != tree_visible.shape[0]:
            tree_visible = tree_visible.expand(prefix_visible.shape[0], 1, group * n, n)
    # visibility as bools over scores (`[B or 1, 1, G*N, P+N]`, no KV-sized tensor): one Where
    visible = torch.cat([prefix_visible, tree_visible], dim=-1)
    scores = torch.cat(
        [torch.matmul(q, past_key.transpose(-1, -2)), torch.matmul(q, key.transpose(-1, -2))], dim=-1
    )
    weights = torch.softmax(torch.where(visible, scores * scale, float("-inf")), dim=-1)
    out = torch.matmul(weights[..., :p], past_value) + torch.matmul(weights[..., p:], value)
    out = out.reshape(b, hq, n, d)
    # a row that sees nothing: all scores -inf, softmax NaN -> 0
    seen = visible.any(dim=-1, keepdim=True)  # [B or 1, 1, G*N, 1]
    seen = seen.reshape(-1, 1, group, n, 1).expand(-1, hkv, group, n, 1).reshape(-1, hq, n, 1)
    return torch.where(seen, out, torch.zeros_like(out[:1, :1, :1, :1]))


@torch.library.custom_op("jetflow::masked_attention", mutates_args=())
def masked_attention(query: Tensor, keys: Tensor, values: Tensor, visible: Tensor, scale: float) -> Tensor:
    """`torch.ops.jetflow.masked_attention`: dense attention as one node, exported as ONNX opset-23
    `Attention` (the plugin-free `attention` graph variant); computes `dense_attention` on eager."""
    return dense_attention(query, keys, values, visible, scale)


@masked_attention.register_fake
def _masked_attention_fake(query, keys, values, visible, scale):  # noqa: ARG001
    return torch.empty_like(query)


def tree_attention_via_masked_attention(
    query: Tensor,
    past_key: Tensor,
    past_value: Tensor,
    key: Tensor,
    value: Tensor,
    packed_mask: Tensor,
    scale: float,
    past_lengths: Tensor | None = None,
    window: int = 0,
) -> Tensor:
    """The contract with the mask unpacked in standard ops and the attention itself one `Attention` node
    (plus a `Where` that pins rows which see nothing to 0, whatever the runtime's Attention gives there)."""
    keys, values, visible = tree_attention_parts(
        query, past_key, past_value, key, value, packed_mask, past_lengths, window
    )
    return _zero_empty_rows(masked_attention(query, keys, values, visible, scale), visible)


@torch.library.custom_op("jetflow::tree_attention", mutates_args=())
def tree_attention(
    query: Tensor,
    past_key: Tensor,
    past_value: Tensor,
    key: Tensor,
    value: Tensor,
    packed_mask: Tensor,
    scale: float,
    past_lengths: Tensor | None = None,
    window: int = 0,
) -> Tensor:
    """`torch.ops.jetflow.tree_attention`: an opaque node for export; computes the reference on eager."""
    return tree_attention_reference(
        query, past_key, past_value, key, value, packed_mask, scale, past_lengths, window
    )


@tree_attention.register_fake
def _tree_attention_fake(
    query, past_key, past_value, key, value, packed_mask, scale, past_lengths=None, window=0
):  # noqa: ARG001
    return torch.empty_like(query)


@tree_attention.register_kernel("cuda")
def _tree_attention_cuda(
    query, past_key, past_value, key, value, packed_mask, scale, past_lengths=None, window=0
):
    """On CUDA tensors the op runs the Triton kernel (same contract), or the reference without Triton or
    with a sliding window (the kernel has no window yet)."""
    from jetflow_pl.ops.triton_tree_attention import is_triton_available, tree_attention_triton

    args = (query, past_key, past_value, key, value, packed_mask, scale)
    if is_triton_available() and window == 0:
        return tree_attention_triton(*args, past_lengths=past_lengths)
    return tree_attention_reference(*args, past_lengths, window)
