"""`jetflow::tree_attention`: the one tree-causal attention contract (torch, ONNX, TensorRT, Triton).

Semantics (DESIGN.md sections 4-5). Per batch row and query head `h` (KV head `h // (Hq / Hkv)`, GQA):

    out[i] = softmax_j(scale * q[i] . K[j]) V[j]   over  j in {all P prefix rows} U {tree rows t : bit t of
                                                                                 packed_mask[i] is set}

Shapes:
    query        [B, Hq,  N, d]   the new rows (tree nodes, or draft-block rows)
    past_key     [B, Hkv, P, d]   the KV prefix (always visible; P may be 0)
    past_value   [B, Hkv, P, d]
    key, value   [B, Hkv, N, d]   K/V of the new rows themselves
    packed_mask  int32 [N, ceil(N/32)]  the TensorRT-LLM packed layout: row i, word w, bit b (LSB first)
                 set iff new row 32w+b is visible from row i (ancestor-or-self). Shared by the batch.
    scale        the softmax scale (usually d ** -0.5)
    returns      [B, Hq, N, d]

The same contract is the ONNX node `jetflow::TreeAttention` (see `export/`), the TensorRT plugin
`TreeAttention` (see `trt_plugins/`) and the Triton kernel. `tree_attention_reference` is written with
export-friendly ops only (integer division against constant powers of two, no bitwise ops, no
data-dependent shapes), so the same function is the body of the `portable` ONNX graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_WORD_BITS = 32


def _bit_values(device: torch.device) -> Tensor:
    """int64 `[32]`: `2 ** b`."""
    return torch.tensor([1 << b for b in range(_WORD_BITS)], dtype=torch.int64, device=device)


def packed_mask_to_dense(packed_mask: Tensor, n: int | torch.SymInt | None = None) -> Tensor:
    """int32 `[..., W]` -> bool `[..., n]` (n defaults to the size of dim -2, i.e. a square tree mask).

    Plain integer arithmetic (bit b of the unsigned word u is `u // 2**b - 2 * (u // 2**(b+1))`), not
    bitwise ops: it exports to ONNX Div/Sub/Cast that every runtime and TensorRT's parser accept
    (TensorRT's ONNX parser only takes BitwiseAnd on bools), and traces with symbolic sizes.
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


def _check_shapes(query: Tensor, past_key: Tensor, past_value: Tensor, key: Tensor, value: Tensor) -> None:
    if query.dim() != 4 or key.dim() != 4 or past_key.dim() != 4:
        raise ValueError("query, key and past_key must be 4-D [B, heads, rows, head_dim]")
    if key.shape != value.shape or past_key.shape != past_value.shape:
        raise ValueError(
            f"key/value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}, "
            f"past {tuple(past_key.shape)} vs {tuple(past_value.shape)}"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} must be a multiple of KV heads {key.shape[1]} (GQA)")


def tree_attention_parts(
    query: Tensor, past_key: Tensor, past_value: Tensor, key: Tensor, value: Tensor, packed_mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The contract as dense attention inputs: K `[B,Hkv,P+N,d]`, V, visibility bool `[N, P+N]`."""
    _check_shapes(query, past_key, past_value, key, value)
    n = query.shape[2]
    keys = torch.cat([past_key.to(query.dtype), key], dim=2)
    values = torch.cat([past_value.to(query.dtype), value], dim=2)
    tree_visible = packed_mask_to_dense(packed_mask, n)  # [N, N]
    prefix_visible = torch.ones_like(tree_visible[:, :1]).expand(n, past_key.shape[2])
    return keys, values, torch.cat([prefix_visible, tree_visible], dim=1)


def dense_attention(query: Tensor, keys: Tensor, values: Tensor, visible: Tensor, scale: float) -> Tensor:
    """SDPA over `[B,Hkv,S,d]` K/V (GQA expanded here) with a bool visibility mask `[N, S]`."""
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
) -> Tensor:
    """Reference implementation (SDPA with a dense boolean mask); see the module docstring."""
    keys, values, visible = tree_attention_parts(query, past_key, past_value, key, value, packed_mask)
    return dense_attention(query, keys, values, visible, scale)


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
) -> Tensor:
    """The contract with the mask unpacked in standard ops and the attention itself one `Attention` node."""
    keys, values, visible = tree_attention_parts(query, past_key, past_value, key, value, packed_mask)
    return masked_attention(query, keys, values, visible, scale)


@torch.library.custom_op("jetflow::tree_attention", mutates_args=())
def tree_attention(
    query: Tensor,
    past_key: Tensor,
    past_value: Tensor,
    key: Tensor,
    value: Tensor,
    packed_mask: Tensor,
    scale: float,
) -> Tensor:
    """`torch.ops.jetflow.tree_attention`: an opaque node for export; computes the reference on eager."""
    return tree_attention_reference(query, past_key, past_value, key, value, packed_mask, scale)


@tree_attention.register_fake
def _tree_attention_fake(query, past_key, past_value, key, value, packed_mask, scale):  # noqa: ARG001
    return torch.empty_like(query)


@tree_attention.register_kernel("cuda")
def _tree_attention_cuda(query, past_key, past_value, key, value, packed_mask, scale):
    """On CUDA tensors the op runs the Triton kernel (same contract), or the reference without Triton."""
    from jetflow_pl.ops.triton_tree_attention import is_triton_available, tree_attention_triton

    if is_triton_available():
        return tree_attention_triton(query, past_key, past_value, key, value, packed_mask, scale)
    return tree_attention_reference(query, past_key, past_value, key, value, packed_mask, scale)
