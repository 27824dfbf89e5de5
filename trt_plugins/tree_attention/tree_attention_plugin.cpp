// TreeAttention IPluginV3 plugin and its creator (see tree_attention_plugin.h for the I/O contract).
// Uses only TensorRT's header-only interfaces, so the library links without libnvinfer.
#include "tree_attention_plugin.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <new>

#include "tree_attention_kernel.cuh"

namespace jetflow {
namespace trt {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::PluginTensorDesc;

namespace {

std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};

constexpr int32_t kNbOutputs = 1;
constexpr int32_t kRank = 4;  // query / keys / values: [B, heads, rows, d]

bool isFloatType(DataType type)
{
    return type == DataType::kFLOAT || type == DataType::kHALF || type == DataType::kBF16;
}

bool toKernelType(DataType type, TreeAttentionDType& out)
{
    switch (type) {
    case DataType::kFLOAT: out = TreeAttentionDType::kFloat32; return true;
    case DataType::kHALF: out = TreeAttentionDType::kFloat16; return true;
    case DataType::kBF16: out = TreeAttentionDType::kBFloat16; return true;
    default: return false;
    }
}

// -1 (or any negative) means "not known yet" during the build; only known sizes are compared.
bool sameOrUnknown(int64_t a, int64_t b)
{
    return a < 0 || b < 0 || a == b;
}

bool fitsInt32(int64_t v)
{
    return v >= 0 && v <= std::numeric_limits<int32_t>::max();
}

bool validInputCount(int32_t nbInputs)
{
    return nbInputs == kTreeAttentionMinInputs || nbInputs == kTreeAttentionMaxInputs;
}

bool isIndexInput(int32_t pos)
{
    return pos == kTreeAttentionMaskInput || pos == kTreeAttentionPastLengthsInput;
}

// The ONNX parser converts an attribute to the type getFieldNames() declares, but callers that build a
// PluginFieldCollection by hand (or another parser version) may pass 64-bit values: accept any width.
bool readInt(PluginField const& field, int32_t& out)
{
    if (field.data == nullptr || field.length < 1) {
        return false;
    }
    int64_t value = 0;
    switch (field.type) {
    case PluginFieldType::kINT8: value = *static_cast<int8_t const*>(field.data); break;
    case PluginFieldType::kINT16: value = *static_cast<int16_t const*>(field.data); break;
    case PluginFieldType::kINT32: value = *static_cast<int32_t const*>(field.data); break;
    case PluginFieldType::kINT64: value = *static_cast<int64_t const*>(field.data); break;
    default: return false;
    }
    if (!fitsInt32(value)) {
        return false;
    }
    out = static_cast<int32_t>(value);
    return true;
}

bool readFloat(PluginField const& field, float& out)
{
    if (field.data == nullptr || field.length < 1) {
        return false;
    }
    switch (field.type) {
    case PluginFieldType::kFLOAT32: out = *static_cast<float const*>(field.data); return true;
    case PluginFieldType::kFLOAT64: out = static_cast<float>(*static_cast<double const*>(field.data)); return true;
    default: return false;
    }
}

bool parseConfig(PluginFieldCollection const* fc, TreeAttentionConfig& config, std::string& error)
{
    if (fc == nullptr || (fc->nbFields > 0 && fc->fields == nullptr)) {
        error = "no plugin fields";
        return false;
    }
    bool haveHeads = false;
    bool haveKvHeads = false;
    bool haveHeadSize = false;
    bool haveScale = false;
    for (int32_t i = 0; i < fc->nbFields; ++i) {
        PluginField const& field = fc->fields[i];
        if (field.name == nullptr) {
            continue;
        }
        std::string const name(field.name);
        bool ok = true;
        if (name == "num_heads") {
            ok = haveHeads = readInt(field, config.numHeads);
        } else if (name == "num_kv_heads") {
            ok = haveKvHeads = readInt(field, config.numKvHeads);
        } else if (name == "head_size") {
            ok = haveHeadSize = readInt(field, config.headSize);
        } else if (name == "scale") {
            ok = haveScale = readFloat(field, config.scale);
        }  // plugin_version / plugin_namespace and unknown fields: ignored
        if (!ok) {
            error = "field '" + name + "' has an unsupported type or value";
            return false;
        }
    }
    if (!haveHeads || !haveKvHeads || !haveHeadSize) {
        error = "num_heads, num_kv_heads and head_size are required";
        return false;
    }
    if (config.numHeads <= 0 || config.numKvHeads <= 0 || config.numHeads % config.numKvHeads != 0) {
        error = "num_heads must be a positive multiple of num_kv_heads (GQA)";
        return false;
    }
    if (!treeAttentionSupportsHeadSize(config.headSize)) {
        error = "head_size must be 64 or 128, got " + std::to_string(config.headSize);
        return false;
    }
    if (!haveScale) {
        config.scale = 1.f / std::sqrt(static_cast<float>(config.headSize));  // the usual d ** -0.5
    }
    if (!std::isfinite(config.scale)) {
        error = "scale must be finite";
        return false;
    }
    return true;
}

}  // namespace

void setPluginLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept
{
    gLoggerFinder.store(finder);
}

void logError(std::string const& message) noexcept
{
    std::string const text = std::string("[TreeAttention plugin] ") + message;
    nvinfer1::ILoggerFinder* finder = gLoggerFinder.load();
    nvinfer1::ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
    if (logger != nullptr) {
        logger->log(nvinfer1::ILogger::Severity::kERROR, text.c_str());
    } else {
        std::fprintf(stderr, "%s\n", text.c_str());
    }
}

// ---------------------------------------------------------------------------------------------- plugin

TreeAttentionPlugin::TreeAttentionPlugin(TreeAttentionConfig const& config)
    : mConfig(config)
{
}

// Copies the attributes and the input count; the serialization storage belongs to each object.
TreeAttentionPlugin::TreeAttentionPlugin(TreeAttentionPlugin const& other)
    : TreeAttentionPlugin(other.mConfig)
{
    mNbInputs = other.mNbInputs;
}

nvinfer1::IPluginCapability* TreeAttentionPlugin::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept
{
    switch (type) {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

nvinfer1::IPluginV3* TreeAttentionPlugin::clone() noexcept
{
    return new (std::nothrow) TreeAttentionPlugin(*this);
}

char const* TreeAttentionPlugin::getPluginName() const noexcept
{
    return kTreeAttentionName;
}

char const* TreeAttentionPlugin::getPluginVersion() const noexcept
{
    return kTreeAttentionVersion;
}

char const* TreeAttentionPlugin::getPluginNamespace() const noexcept
{
    return kTreeAttentionNamespace;
}

int32_t TreeAttentionPlugin::getNbOutputs() const noexcept
{
    return kNbOutputs;
}

int32_t TreeAttentionPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                                int32_t nbInputs) const noexcept
{
    if (outputTypes == nullptr || inputTypes == nullptr || nbOutputs != kNbOutputs || !validInputCount(nbInputs)) {
        return -1;
    }
    outputTypes[0] = inputTypes[0];
    return 0;
}

int32_t TreeAttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
                                             DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/,
                                             DimsExprs* outputs, int32_t nbOutputs,
                                             nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    if (inputs == nullptr || outputs == nullptr || !validInputCount(nbInputs) || nbOutputs != kNbOutputs
        || inputs[0].nbDims != kRank) {
        return -1;
    }
    outputs[0] = inputs[0];  // out has the query's shape: [B, Hq, N, d]
    return 0;
}

bool TreeAttentionPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut,
                                                    int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (inOut == nullptr || !validInputCount(nbInputs) || nbOutputs != kNbOutputs || pos < 0
        || pos >= nbInputs + nbOutputs) {
        return false;
    }
    PluginTensorDesc const& desc = inOut[pos].desc;
    if (desc.format != nvinfer1::TensorFormat::kLINEAR) {
        return false;  // the kernel indexes dense row-major tensors
    }
    if (pos < nbInputs && isIndexInput(pos)) {  // packed_mask and past_lengths
        return desc.type == DataType::kINT32;
    }
    if (pos == 0) {
        return isFloatType(desc.type);
    }
    // TensorRT has already fixed positions < pos: every other tensor (the output included, at position
    // nbInputs) follows the query's type.
    return desc.type == inOut[0].desc.type;
}

bool TreeAttentionPlugin::checkShapes(Dims const* dims, int32_t nbInputs) const noexcept
{
    if (!validInputCount(nbInputs)) {
        logError("expected 6 inputs (or 7 with past_lengths), got " + std::to_string(nbInputs));
        return false;
    }
    for (int32_t i = 0; i < kTreeAttentionMaskInput; ++i) {
        if (dims[i].nbDims != kRank || !sameOrUnknown(dims[i].d[3], mConfig.headSize)
            || !sameOrUnknown(dims[i].d[0], dims[0].d[0])) {
            logError("input " + std::to_string(i) + " must be [B, heads, rows, " + std::to_string(mConfig.headSize)
                     + "]");
            return false;
        }
        int64_t const heads = i == 0 ? mConfig.numHeads : mConfig.numKvHeads;
        if (!sameOrUnknown(dims[i].d[1], heads)) {
            logError("input " + std::to_string(i) + " must have " + std::to_string(heads) + " heads");
            return false;
        }
    }
    Dims const& query = dims[0];
    Dims const& mask = dims[kTreeAttentionMaskInput];
    bool const pastOk = sameOrUnknown(dims[1].d[2], dims[2].d[2]);
    bool const newOk = sameOrUnknown(dims[3].d[2], query.d[2]) && sameOrUnknown(dims[4].d[2], query.d[2]);
    // [N, W] shared by the batch, or [B, N, W] per request: the last two axes are rows and words.
    int32_t const rowsAxis = mask.nbDims - 2;
    bool const maskOk = (mask.nbDims == 2 || (mask.nbDims == 3 && sameOrUnknown(mask.d[0], query.d[0])))
                        && sameOrUnknown(mask.d[rowsAxis], query.d[2])
                        && (query.d[2] < 0 || mask.d[rowsAxis + 1] < 0 || mask.d[rowsAxis + 1] * 32 >= query.d[2]);
    if (!pastOk || !newOk || !maskOk) {
        logError("inconsistent shapes: past_key/past_value rows, key/value/query rows N and mask [N, >= ceil(N/32)] "
                 "or [B, N, >= ceil(N/32)]");
        return false;
    }
    if (nbInputs == kTreeAttentionMaxInputs) {
        Dims const& lengths = dims[kTreeAttentionPastLengthsInput];
        if (lengths.nbDims != 1 || !sameOrUnknown(lengths.d[0], query.d[0])) {
            logError("past_lengths must be [B]");
            return false;
        }
    }
    return true;
}

int32_t TreeAttentionPlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                             DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    if (in == nullptr || out == nullptr || !validInputCount(nbInputs) || nbOutputs != kNbOutputs) {
        return -1;
    }
    Dims dims[kTreeAttentionMaxInputs];
    for (int32_t i = 0; i < nbInputs; ++i) {
        dims[i] = in[i].desc.dims;
    }
    if (!checkShapes(dims, nbInputs)) {
        return -1;
    }
    mNbInputs = nbInputs;
    return 0;
}

size_t TreeAttentionPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
                                             DynamicPluginTensorDesc const* /*outputs*/,
                                             int32_t /*nbOutputs*/) const noexcept
{
    return 0;  // online softmax keeps all state in registers and shared memory
}

int32_t TreeAttentionPlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs,
                                           PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    if (in == nullptr || out == nullptr || !validInputCount(nbInputs) || nbOutputs != kNbOutputs) {
        return -1;
    }
    Dims dims[kTreeAttentionMaxInputs];
    for (int32_t i = 0; i < nbInputs; ++i) {
        dims[i] = in[i].dims;
    }
    if (!checkShapes(dims, nbInputs)) {
        return -1;
    }
    mNbInputs = nbInputs;
    return 0;
}

int32_t TreeAttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
                                     void const* const* inputs, void* const* outputs, void* /*workspace*/,
                                     cudaStream_t stream) noexcept
{
    if (inputDesc == nullptr || inputs == nullptr || outputs == nullptr) {
        return -1;
    }
    if (!validInputCount(mNbInputs)) {
        logError("enqueue() before onShapeChange(): the number of inputs is unknown");
        return -1;
    }
    Dims const& query = inputDesc[0].dims;
    Dims const& pastKey = inputDesc[1].dims;
    Dims const& key = inputDesc[3].dims;
    Dims const& mask = inputDesc[kTreeAttentionMaskInput].dims;
    TreeAttentionDType dtype{};
    if (!toKernelType(inputDesc[0].type, dtype)) {
        logError("unsupported query data type");
        return -1;
    }
    bool const perRequestMask = mask.nbDims == 3;
    int64_t const maskWords = mask.d[mask.nbDims - 1];
    int64_t const sizes[] = {query.d[0], query.d[1], query.d[2], query.d[3], key.d[1], pastKey.d[2], maskWords};
    for (int64_t size : sizes) {
        if (!fitsInt32(size)) {
            logError("tensor dimension out of int32 range");
            return -1;
        }
    }
    TreeAttentionParams params;
    params.query = inputs[0];
    params.past_key = inputs[1];
    params.past_value = inputs[2];
    params.key = inputs[3];
    params.value = inputs[4];
    params.packed_mask = static_cast<int32_t const*>(inputs[kTreeAttentionMaskInput]);
    params.past_lengths = mNbInputs == kTreeAttentionMaxInputs
                              ? static_cast<int32_t const*>(inputs[kTreeAttentionPastLengthsInput])
                              : nullptr;
    params.out = outputs[0];
    params.batch = static_cast<int32_t>(query.d[0]);
    params.num_heads = static_cast<int32_t>(query.d[1]);
    params.num_new = static_cast<int32_t>(query.d[2]);
    params.head_size = static_cast<int32_t>(query.d[3]);
    params.num_kv_heads = static_cast<int32_t>(key.d[1]);
    params.num_past = static_cast<int32_t>(pastKey.d[2]);
    params.mask_words = static_cast<int32_t>(maskWords);
    params.mask_batch_stride = perRequestMask ? mask.d[1] * maskWords : 0;  // [B, N, W] or shared [N, W]
    params.scale = mConfig.scale;
    cudaError_t const status = launchTreeAttention(params, dtype, stream);
    if (status != cudaSuccess) {
        logError(std::string("kernel launch failed: ") + cudaGetErrorString(status));
        return -1;
    }
    return 0;
}

nvinfer1::IPluginV3* TreeAttentionPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept
{
    return clone();  // no per-context resources
}

PluginFieldCollection const* TreeAttentionPlugin::getFieldsToSerialize() noexcept
{
    mSerialFields.clear();
    mSerialFields.emplace_back("num_heads", &mConfig.numHeads, PluginFieldType::kINT32, 1);
    mSerialFields.emplace_back("num_kv_heads", &mConfig.numKvHeads, PluginFieldType::kINT32, 1);
    mSerialFields.emplace_back("head_size", &mConfig.headSize, PluginFieldType::kINT32, 1);
    mSerialFields.emplace_back("scale", &mConfig.scale, PluginFieldType::kFLOAT32, 1);
    mSerialCollection.nbFields = static_cast<int32_t>(mSerialFields.size());
    mSerialCollection.fields = mSerialFields.data();
    return &mSerialCollection;
}

// --------------------------------------------------------------------------------------------- creator

TreeAttentionPluginCreator::TreeAttentionPluginCreator()
{
    mFields.emplace_back("num_heads", nullptr, PluginFieldType::kINT32, 1);
    mFields.emplace_back("num_kv_heads", nullptr, PluginFieldType::kINT32, 1);
    mFields.emplace_back("head_size", nullptr, PluginFieldType::kINT32, 1);
    mFields.emplace_back("scale", nullptr, PluginFieldType::kFLOAT32, 1);
    mFields.emplace_back("plugin_version", nullptr, PluginFieldType::kCHAR, 0);
    mFields.emplace_back("plugin_namespace", nullptr, PluginFieldType::kCHAR, 0);
    mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
    mFieldCollection.fields = mFields.data();
}

char const* TreeAttentionPluginCreator::getPluginName() const noexcept
{
    return kTreeAttentionName;
}

char const* TreeAttentionPluginCreator::getPluginVersion() const noexcept
{
    return kTreeAttentionVersion;
}

char const* TreeAttentionPluginCreator::getPluginNamespace() const noexcept
{
    return kTreeAttentionNamespace;
}

PluginFieldCollection const* TreeAttentionPluginCreator::getFieldNames() noexcept
{
    return &mFieldCollection;
}

// The build phase passes the ONNX node's attributes; the runtime phase passes getFieldsToSerialize()'s
// output. Both carry the same names, so one parser serves both.
nvinfer1::IPluginV3* TreeAttentionPluginCreator::createPlugin(char const* /*name*/, PluginFieldCollection const* fc,
                                                              nvinfer1::TensorRTPhase /*phase*/) noexcept
{
    TreeAttentionConfig config;
    std::string error;
    if (!parseConfig(fc, config, error)) {
        logError(error);
        return nullptr;
    }
    return new (std::nothrow) TreeAttentionPlugin(config);
}

}  // namespace trt
}  // namespace jetflow
