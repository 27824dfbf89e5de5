// TensorRT IPluginV3 plugin "TreeAttention" (version "1", namespace ""): the TensorRT side of the
// `jetflow::tree_attention` contract (jetflow_pl/ops/tree_attention.py). TensorRT's ONNX parser maps an
// ONNX node with op_type "TreeAttention" to this plugin by name, passing the node's attributes as fields.
//
// Inputs (in this order, as in the ONNX node; 6, or 7 with past_lengths):
//   0 query        [B, Hq,  N, d]           fp32 | fp16 | bf16
//   1 past_key     [B, Hkv, P, d]           same type as query; P may be 0
//   2 past_value   [B, Hkv, P, d]
//   3 key          [B, Hkv, N, d]
//   4 value        [B, Hkv, N, d]
//   5 packed_mask  [N, W] or [B, N, W]      int32, W >= ceil(N / 32); shared by the batch, or per request
//   6 past_lengths [B] (optional)           int32: request b sees prefix rows [0, past_lengths[b]) (clamped
//                                           to [0, P]); without it every request sees all P rows
// Output:
//   0 out         [B, Hq, N, d]    same type and shape as query
// Fields: num_heads (Hq), num_kv_heads (Hkv), head_size (d: 64 or 128), scale (float), plus the ONNX node's
// plugin_version / plugin_namespace strings, which are accepted and ignored (the creator carries both).
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace jetflow {
namespace trt {

constexpr char const* kTreeAttentionName = "TreeAttention";
constexpr char const* kTreeAttentionVersion = "1";
constexpr char const* kTreeAttentionNamespace = "";
constexpr int32_t kTreeAttentionMinInputs = 6;  // without past_lengths (the batch-1 form)
constexpr int32_t kTreeAttentionMaxInputs = 7;  // with past_lengths
constexpr int32_t kTreeAttentionMaskInput = 5;
constexpr int32_t kTreeAttentionPastLengthsInput = 6;

//! The plugin's attributes (everything that is serialized into an engine).
struct TreeAttentionConfig {
    int32_t numHeads = 0;
    int32_t numKvHeads = 0;
    int32_t headSize = 0;
    float scale = 0.f;
};

//! Logs through TensorRT's logger when the library was loaded by TensorRT (setLoggerFinder), else stderr.
void logError(std::string const& message) noexcept;

//! Remembers TensorRT's logger finder (called from the exported setLoggerFinder entry point).
void setPluginLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;

class TreeAttentionPlugin final : public nvinfer1::IPluginV3,
                                  public nvinfer1::IPluginV3OneCore,
                                  public nvinfer1::IPluginV3OneBuild,
                                  public nvinfer1::IPluginV3OneRuntime {
public:
    explicit TreeAttentionPlugin(TreeAttentionConfig const& config);
    TreeAttentionPlugin(TreeAttentionPlugin const& other);
    TreeAttentionPlugin& operator=(TreeAttentionPlugin const&) = delete;
    ~TreeAttentionPlugin() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                               nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                            nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs,
                            nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                            nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                            nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                            nvinfer1::DynamicPluginTensorDesc const* outputs,
                            int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
                          int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                    void const* const* inputs, void* const* outputs, void* workspace,
                    cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

    TreeAttentionConfig const& config() const noexcept { return mConfig; }

private:
    //! Checks ranks and the head counts / head size against the config; -1 (unknown) dims pass.
    bool checkShapes(nvinfer1::Dims const* inputDims, int32_t nbInputs) const noexcept;

    TreeAttentionConfig mConfig;
    // Inputs of the node this instance runs (6 or 7), recorded by configurePlugin / onShapeChange because
    // enqueue() is not told; 0 until then.
    int32_t mNbInputs = 0;
    // Storage behind getFieldsToSerialize(); rebuilt on every call, pointing into mConfig.
    std::vector<nvinfer1::PluginField> mSerialFields;
    nvinfer1::PluginFieldCollection mSerialCollection{};
};

class TreeAttentionPluginCreator final : public nvinfer1::IPluginCreatorV3One {
public:
    TreeAttentionPluginCreator();
    ~TreeAttentionPluginCreator() override = default;

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                      nvinfer1::TensorRTPhase phase) noexcept override;

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

}  // namespace trt
}  // namespace jetflow
