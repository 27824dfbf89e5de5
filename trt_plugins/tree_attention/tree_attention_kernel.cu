// Tree attention CUDA kernel (see tree_attention_kernel.cuh for the contract).
//
// Work split: one thread block per (query-row tile, query head, request); one warp per query row, so a
// block of kRowsPerBlock warps shares every K/V tile it loads into shared memory. Keys are visited in
// tiles of 32: first the request's valid prefix rows (visible from every row; the loop ends at
// past_lengths[b], so padding rows are never loaded), then the N tree rows, whose tile t lines up with
// mask word t, so a lane's visibility is one bit of one word. Each lane scores one key of the tile, the
// warp folds the 32 scores into a running (max, sum, accumulator) online softmax in fp32, and each lane
// owns d / 32 output dimensions. Nothing is sized by P, so the prefix can be arbitrarily long.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "tree_attention_kernel.cuh"

namespace jetflow {
namespace {

constexpr int kWarpSize = 32;
constexpr int kTileKeys = 32;      // one key per lane; also the bits in one mask word
constexpr int kRowsPerBlock = 8;   // warps (= query rows) per block sharing one K/V tile
constexpr int kThreads = kRowsPerBlock * kWarpSize;
// Occupancy hint for ptxas (at most 64 registers per thread): without it, ptxas 13 aims at ~40-48
// registers for some instantiations and spills a few bytes of the online-softmax state to local memory.
constexpr int kMinBlocksPerSm = 4;
constexpr unsigned kFullWarp = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;  // scores are kept in base 2 so exp2f can be used

static_assert(kTileKeys == kWarpSize, "a tree tile must map to exactly one 32-bit mask word");

// fp32 <-> storage type. Accumulation is always fp32; storage is rounded to nearest on the way out.
template <typename T>
struct Convert;

template <>
struct Convert<float> {
    __device__ static float toFloat(float x) { return x; }
    __device__ static float fromFloat(float x) { return x; }
};

template <>
struct Convert<__half> {
    __device__ static float toFloat(__half x) { return __half2float(x); }
    __device__ static __half fromFloat(float x) { return __float2half_rn(x); }
};

template <>
struct Convert<__nv_bfloat16> {
    __device__ static float toFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
    __device__ static __nv_bfloat16 fromFloat(float x) { return __float2bfloat16_rn(x); }
};

__device__ __forceinline__ float warpMax(float v)
{
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        v = fmaxf(v, __shfl_xor_sync(kFullWarp, v, offset));
    }
    return v;
}

__device__ __forceinline__ float warpSum(float v)
{
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        v += __shfl_xor_sync(kFullWarp, v, offset);
    }
    return v;
}

// Shared memory of one block, in fp32 so the inner loops convert nothing. K rows are padded by one float
// so that lane j reading key j, dim c hits bank (j + c) % 32: no bank conflicts in the score loop.
template <int D>
struct SharedTiles {
    float q[kRowsPerBlock][D];  // query rows, pre-multiplied by scale * log2(e)
    float k[kTileKeys][D + 1];
    float v[kTileKeys][D];
};

// Online-softmax state of one query row; m and l are warp-uniform, acc holds this lane's d / 32 dims.
template <int D>
struct RowState {
    float m;  // running max of base-2 scores (-inf until the first visible key)
    float l;  // running sum of exp2(score - m)
    float acc[D / kWarpSize];
};

// Loads `count` (<= 32) consecutive K/V rows starting at `key`/`value` into the tile; the rest of the
// tile is zero-filled so that no stale value can reach the accumulator as 0 * NaN.
template <typename T, int D>
__device__ __forceinline__ void loadTile(SharedTiles<D>& s, T const* __restrict__ key, T const* __restrict__ value,
                         int count)
{
    for (int idx = threadIdx.x; idx < kTileKeys * D; idx += kThreads) {
        int const r = idx / D;
        int const c = idx % D;
        float kv = 0.f;
        float vv = 0.f;
        if (r < count) {
            kv = Convert<T>::toFloat(key[static_cast<int64_t>(r) * D + c]);
            vv = Convert<T>::toFloat(value[static_cast<int64_t>(r) * D + c]);
        }
        s.k[r][c] = kv;
        s.v[r][c] = vv;
    }
}

// Folds the tile in shared memory into `st` for query row `row` of the block. `visible` is this lane's
// key (lane < count is implied by the caller); must be called by all 32 lanes of the warp.
template <int D>
__device__ __forceinline__ void attendTile(SharedTiles<D> const& s, int row, int count, bool visible, RowState<D>& st)
{
    int const lane = threadIdx.x % kWarpSize;
    float score = -INFINITY;
    if (visible) {
        float dot = 0.f;
#pragma unroll 8
        for (int c = 0; c < D; ++c) {
            dot = fmaf(s.q[row][c], s.k[lane][c], dot);
        }
        score = dot;
    }
    float const tileMax = warpMax(score);
    if (tileMax == -INFINITY) {
        return;  // nothing visible in this tile for this row (warp-uniform branch)
    }
    float const mNew = fmaxf(st.m, tileMax);
    float const alpha = exp2f(st.m - mNew);  // 0 on the first visible tile (m = -inf, mNew finite)
    float const p = visible ? exp2f(score - mNew) : 0.f;
    st.l = st.l * alpha + warpSum(p);
#pragma unroll
    for (int c = 0; c < D / kWarpSize; ++c) {
        st.acc[c] *= alpha;
    }
    for (int j = 0; j < count; ++j) {
        float const pj = __shfl_sync(kFullWarp, p, j);
#pragma unroll
        for (int c = 0; c < D / kWarpSize; ++c) {
            st.acc[c] = fmaf(pj, s.v[j][lane + c * kWarpSize], st.acc[c]);
        }
    }
    st.m = mNew;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) treeAttentionKernel(TreeAttentionParams p)
{
    static_assert(D % kWarpSize == 0, "head size must be a multiple of the warp size");
    __shared__ SharedTiles<D> s;

    int const warp = threadIdx.x / kWarpSize;
    int const lane = threadIdx.x % kWarpSize;
    int const head = blockIdx.y;
    int const batch = blockIdx.z;
    int const kvHead = head / (p.num_heads / p.num_kv_heads);
    int const row = blockIdx.x * kRowsPerBlock + warp;
    // Rows past N (last tile) still take part in every barrier and tile load; they just score nothing.
    bool const rowValid = row < p.num_new;

    int64_t const qBase = (static_cast<int64_t>(batch) * p.num_heads + head) * p.num_new * D;
    int64_t const kvHeadIndex = static_cast<int64_t>(batch) * p.num_kv_heads + kvHead;
    // Pointers are formed where they are used (from the kernel parameters), which keeps the live
    // register set of each loop small enough that ptxas never spills.
    float const qScale = p.scale * kLog2e;
    T const* query = static_cast<T const*>(p.query) + qBase;
#pragma unroll
    for (int c = 0; c < D / kWarpSize; ++c) {
        int const dim = lane + c * kWarpSize;
        s.q[warp][dim] = rowValid ? Convert<T>::toFloat(query[static_cast<int64_t>(row) * D + dim]) * qScale : 0.f;
    }

    RowState<D> st;
    st.m = -INFINITY;
    st.l = 0.f;
#pragma unroll
    for (int c = 0; c < D / kWarpSize; ++c) {
        st.acc[c] = 0.f;
    }

    // 1) The request's valid KV prefix: visible from every row, no mask test. numPast is block-uniform
    //    (one request per block), so every warp reaches the same barriers.
    {
        int const numPast =
            p.past_lengths != nullptr ? min(max(p.past_lengths[batch], 0), p.num_past) : p.num_past;
        T const* pastKey = static_cast<T const*>(p.past_key) + kvHeadIndex * p.num_past * D;
        T const* pastValue = static_cast<T const*>(p.past_value) + kvHeadIndex * p.num_past * D;
        for (int start = 0; start < numPast; start += kTileKeys) {
            int const count = min(kTileKeys, numPast - start);
            __syncthreads();  // every warp is done with the previous tile (and q is written, first time)
            loadTile<T, D>(s, pastKey + static_cast<int64_t>(start) * D,
                           pastValue + static_cast<int64_t>(start) * D, count);
            __syncthreads();
            if (rowValid) {
                attendTile<D>(s, warp, count, lane < count, st);
            }
        }
    }

    // 2) Tree rows: tile t is mask word t of the request's mask row. A tile no row of this block can see
    //    is not even loaded.
    {
        T const* key = static_cast<T const*>(p.key) + kvHeadIndex * p.num_new * D;
        T const* value = static_cast<T const*>(p.value) + kvHeadIndex * p.num_new * D;
        int32_t const* maskRow = p.packed_mask + static_cast<int64_t>(batch) * p.mask_batch_stride
                                 + static_cast<int64_t>(row) * p.mask_words;
        int const numTiles = (p.num_new + kTileKeys - 1) / kTileKeys;
        for (int tile = 0; tile < numTiles; ++tile) {
            int const start = tile * kTileKeys;
            int const count = min(kTileKeys, p.num_new - start);
            uint32_t const word = rowValid ? static_cast<uint32_t>(maskRow[tile]) : 0u;
            // Also the barrier that ends the previous tile's use of shared memory.
            if (!__syncthreads_or(word != 0u)) {
                continue;
            }
            loadTile<T, D>(s, key + static_cast<int64_t>(start) * D, value + static_cast<int64_t>(start) * D,
                           count);
            __syncthreads();
            if (word != 0u) {  // bits at or past `count` (beyond N) are ignored
                attendTile<D>(s, warp, count, lane < count && ((word >> lane) & 1u) != 0u, st);
            }
        }
    }

    if (rowValid) {
        T* out = static_cast<T*>(p.out) + qBase;
        float const inv = st.l > 0.f ? 1.f / st.l : 0.f;
#pragma unroll
        for (int c = 0; c < D / kWarpSize; ++c) {
            int const dim = lane + c * kWarpSize;
            out[static_cast<int64_t>(row) * D + dim] = Convert<T>::fromFloat(st.acc[c] * inv);
        }
    }
}

template <typename T, int D>
cudaError_t launchTyped(TreeAttentionParams const& p, cudaStream_t stream)
{
    dim3 const grid((p.num_new + kRowsPerBlock - 1) / kRowsPerBlock, p.num_heads, p.batch);
    treeAttentionKernel<T, D><<<grid, kThreads, 0, stream>>>(p);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launchForHeadSize(TreeAttentionParams const& p, cudaStream_t stream)
{
    switch (p.head_size) {
    case 64: return launchTyped<T, 64>(p, stream);
    case 128: return launchTyped<T, 128>(p, stream);
    default: return cudaErrorInvalidValue;
    }
}

bool validShapes(TreeAttentionParams const& p)
{
    constexpr int32_t kMaxGridYZ = 65535;
    if (p.batch < 0 || p.num_heads < 0 || p.num_new < 0 || p.num_past < 0 || p.num_kv_heads <= 0) {
        return false;
    }
    if (!treeAttentionSupportsHeadSize(p.head_size) || p.num_heads % p.num_kv_heads != 0) {
        return false;
    }
    if (p.num_heads > kMaxGridYZ || p.batch > kMaxGridYZ) {
        return false;
    }
    if (p.mask_words < (p.num_new + kTileKeys - 1) / kTileKeys || p.mask_batch_stride < 0) {
        return false;
    }
    bool const hasPast = p.num_past == 0 || (p.past_key != nullptr && p.past_value != nullptr);
    return hasPast && p.query != nullptr && p.key != nullptr && p.value != nullptr && p.packed_mask != nullptr
           && p.out != nullptr;
}

}  // namespace

cudaError_t launchTreeAttention(TreeAttentionParams const& params, TreeAttentionDType dtype,
                                cudaStream_t stream) noexcept
{
    if (params.batch == 0 || params.num_heads == 0 || params.num_new == 0) {
        return cudaSuccess;  // nothing to write
    }
    if (!validShapes(params)) {
        return cudaErrorInvalidValue;
    }
    switch (dtype) {
    case TreeAttentionDType::kFloat32: return launchForHeadSize<float>(params, stream);
    case TreeAttentionDType::kFloat16: return launchForHeadSize<__half>(params, stream);
    case TreeAttentionDType::kBFloat16: return launchForHeadSize<__nv_bfloat16>(params, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace jetflow
