// Tree attention: the host-side interface of the CUDA kernel shared by the TensorRT plugin and the torch
// extension. This header is plain C++ (no device code) so that the plugin .cpp, compiled by the host
// compiler, can include it; the templated kernel itself lives in tree_attention_kernel.cu.
//
// Contract (the same as jetflow_pl/ops/tree_attention.py): per request b and query head h, with KV head
// h / (Hq / Hkv) (GQA),
//
//   out[b, h, i] = softmax_j(scale * q[i] . K[j]) V[j],  j over the prefix rows p < past_lengths[b] (all P
//                  rows without past_lengths) and the tree rows t whose bit (word t / 32, bit t % 32, LSB
//                  first) is set in request b's packed_mask row i; 0 when that set is empty.
//
// Layouts are dense and row-major: query/out [B, Hq, N, d], past_key/past_value [B, Hkv, P, d],
// key/value [B, Hkv, N, d], packed_mask int32 [N, W] shared by the batch (mask_batch_stride 0) or
// [B, N, W] per request (mask_batch_stride N * W), W >= ceil(N / 32), past_lengths int32 [B] (optional;
// clamped to [0, P]). Prefix rows at or past past_lengths[b] are never read, so they may hold anything.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jetflow {

//! Element type of query, keys, values and output (the mask is always int32).
enum class TreeAttentionDType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

//! Everything one launch needs. Pointers are device pointers; sizes are element counts.
struct TreeAttentionParams {
    void const* query = nullptr;       // [B, Hq, N, d]
    void const* past_key = nullptr;    // [B, Hkv, P, d]; may be null when P == 0
    void const* past_value = nullptr;  // [B, Hkv, P, d]; may be null when P == 0
    void const* key = nullptr;         // [B, Hkv, N, d]
    void const* value = nullptr;       // [B, Hkv, N, d]
    int32_t const* packed_mask = nullptr;  // [N, mask_words] or [B, N, mask_words]
    int32_t const* past_lengths = nullptr;  // [B] valid prefix rows per request; null: all P rows
    void* out = nullptr;               // [B, Hq, N, d]
    int32_t batch = 0;                 // B
    int32_t num_heads = 0;             // Hq
    int32_t num_kv_heads = 0;          // Hkv (divides Hq)
    int32_t num_new = 0;               // N (tree nodes / new rows)
    int32_t num_past = 0;              // P (KV prefix rows, always visible; may be 0)
    int32_t head_size = 0;             // d: 64 or 128
    int32_t mask_words = 0;            // W: row stride of packed_mask, >= ceil(N / 32)
    int64_t mask_batch_stride = 0;     // elements between two requests' masks: 0 (shared) or N * W
    float scale = 0.f;                 // softmax scale, usually d ** -0.5
};

//! Head sizes the kernel is instantiated for.
constexpr bool treeAttentionSupportsHeadSize(int32_t headSize) noexcept
{
    return headSize == 64 || headSize == 128;
}

//! Validates `params` and enqueues the kernel on `stream`. Returns cudaErrorInvalidValue for a shape the
//! kernel does not handle (bad head size, Hq not a multiple of Hkv, too few mask words, a negative mask
//! batch stride, grid too large),
//! otherwise the launch status. An empty problem (B, Hq or N == 0) enqueues nothing.
cudaError_t launchTreeAttention(TreeAttentionParams const& params, TreeAttentionDType dtype,
                                cudaStream_t stream) noexcept;

}  // namespace jetflow
