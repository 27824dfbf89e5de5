// Torch binding of the TreeAttention CUDA kernel: the very kernel the TensorRT plugin enqueues, callable
// on torch tensors so its numerics can be checked against jetflow_pl.ops.tree_attention_reference on a
// GPU without TensorRT. Built on demand by torch_ext/__init__.py (torch.utils.cpp_extension.load).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <limits>

#include "tree_attention_kernel.cuh"

namespace {

jetflow::TreeAttentionDType kernelType(at::ScalarType type)
{
    switch (type) {
    case at::kFloat: return jetflow::TreeAttentionDType::kFloat32;
    case at::kHalf: return jetflow::TreeAttentionDType::kFloat16;
    case at::kBFloat16: return jetflow::TreeAttentionDType::kBFloat16;
    default: TORCH_CHECK(false, "tree_attention_cuda: query must be float32, float16 or bfloat16, got ", type);
    }
}

int32_t toInt32(int64_t value, char const* what)
{
    TORCH_CHECK(value >= 0 && value <= std::numeric_limits<int32_t>::max(), "tree_attention_cuda: ", what,
                " out of int32 range: ", value);
    return static_cast<int32_t>(value);
}

void checkTensor(at::Tensor const& t, char const* name, at::Tensor const& query, at::ScalarType dtype, int64_t dim)
{
    TORCH_CHECK(t.device() == query.device(), "tree_attention_cuda: ", name, " must be on ", query.device());
    TORCH_CHECK(t.scalar_type() == dtype, "tree_attention_cuda: ", name, " must be ", dtype, ", got ",
                t.scalar_type());
    TORCH_CHECK(t.dim() == dim, "tree_attention_cuda: ", name, " must be ", dim, "-D, got ", t.sizes());
}

}  // namespace

at::Tensor tree_attention_cuda(at::Tensor const& query, at::Tensor const& past_key, at::Tensor const& past_value,
                               at::Tensor const& key, at::Tensor const& value, at::Tensor const& packed_mask,
                               double scale, c10::optional<at::Tensor> const& past_lengths)
{
    TORCH_CHECK(query.is_cuda(), "tree_attention_cuda: tensors must be on a CUDA device");
    at::ScalarType const dtype = query.scalar_type();
    checkTensor(query, "query", query, dtype, 4);
    checkTensor(past_key, "past_key", query, dtype, 4);
    checkTensor(past_value, "past_value", query, dtype, 4);
    checkTensor(key, "key", query, dtype, 4);
    checkTensor(value, "value", query, dtype, 4);
    TORCH_CHECK(packed_mask.dim() == 2 || packed_mask.dim() == 3,
                "tree_attention_cuda: packed_mask must be [N, W] or [B, N, W], got ", packed_mask.sizes());
    checkTensor(packed_mask, "packed_mask", query, at::kInt, packed_mask.dim());
    if (past_lengths.has_value()) {
        checkTensor(*past_lengths, "past_lengths", query, at::kInt, 1);
    }

    int64_t const batch = query.size(0), heads = query.size(1), rows = query.size(2), headSize = query.size(3);
    int64_t const kvHeads = key.size(1), pastRows = past_key.size(2);
    TORCH_CHECK(key.sizes() == value.sizes() && past_key.sizes() == past_value.sizes(),
                "tree_attention_cuda: key/value (and past_key/past_value) shapes must match");
    TORCH_CHECK(key.size(0) == batch && key.size(2) == rows && key.size(3) == headSize,
                "tree_attention_cuda: key must be [B, Hkv, N, d] with query [B, Hq, N, d]");
    TORCH_CHECK(past_key.size(0) == batch && past_key.size(1) == kvHeads && past_key.size(3) == headSize,
                "tree_attention_cuda: past_key must be [B, Hkv, P, d]");
    TORCH_CHECK(kvHeads > 0 && heads % kvHeads == 0, "tree_attention_cuda: Hq must be a multiple of Hkv");
    TORCH_CHECK(jetflow::treeAttentionSupportsHeadSize(static_cast<int32_t>(headSize)),
                "tree_attention_cuda: head size must be 64 or 128, got ", headSize);
    bool const perRequestMask = packed_mask.dim() == 3;
    int64_t const maskRows = packed_mask.size(-2), maskWords = packed_mask.size(-1);
    TORCH_CHECK(maskRows == rows && maskWords * 32 >= rows && (!perRequestMask || packed_mask.size(0) == batch),
                "tree_attention_cuda: packed_mask must be [N, >= ceil(N/32)] or [B, N, >= ceil(N/32)], got ",
                packed_mask.sizes());
    TORCH_CHECK(!past_lengths.has_value() || past_lengths->size(0) == batch,
                "tree_attention_cuda: past_lengths must be [B], got ", past_lengths.has_value() ? past_lengths->sizes() : at::IntArrayRef{});

    c10::cuda::CUDAGuard const guard(query.device());
    // The kernel indexes dense row-major tensors; these are no-ops for the usual contiguous inputs.
    at::Tensor const q = query.contiguous();
    at::Tensor const pk = past_key.contiguous();
    at::Tensor const pv = past_value.contiguous();
    at::Tensor const k = key.contiguous();
    at::Tensor const v = value.contiguous();
    at::Tensor const mask = packed_mask.contiguous();
    at::Tensor const lengths = past_lengths.has_value() ? past_lengths->contiguous() : at::Tensor();
    at::Tensor out = at::empty_like(q);

    jetflow::TreeAttentionParams params;
    params.query = q.data_ptr();
    params.past_key = pk.data_ptr();
    params.past_value = pv.data_ptr();
    params.key = k.data_ptr();
    params.value = v.data_ptr();
    params.packed_mask = mask.data_ptr<int32_t>();
    params.past_lengths = lengths.defined() ? lengths.data_ptr<int32_t>() : nullptr;
    params.out = out.data_ptr();
    params.batch = toInt32(batch, "B");
    params.num_heads = toInt32(heads, "Hq");
    params.num_kv_heads = toInt32(kvHeads, "Hkv");
    params.num_new = toInt32(rows, "N");
    params.num_past = toInt32(pastRows, "P");
    params.head_size = toInt32(headSize, "d");
    params.mask_words = toInt32(maskWords, "W");
    params.mask_batch_stride = perRequestMask ? maskRows * maskWords : 0;
    params.scale = static_cast<float>(scale);

    cudaError_t const status =
        jetflow::launchTreeAttention(params, kernelType(dtype), c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(status == cudaSuccess, "tree_attention_cuda: kernel launch failed: ", cudaGetErrorString(status));
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("tree_attention_cuda", &tree_attention_cuda,
          "Tree attention with a packed int32 mask (the TensorRT TreeAttention plugin's kernel)", py::arg("query"),
          py::arg("past_key"), py::arg("past_value"), py::arg("key"), py::arg("value"), py::arg("packed_mask"),
          py::arg("scale"), py::arg("past_lengths") = py::none());
}
