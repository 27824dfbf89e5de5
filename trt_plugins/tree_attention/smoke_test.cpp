// Smoke test of libjetflow_trt_plugins.so as TensorRT would see it, without libnvinfer: dlopen the
// library, call its C entry points, find the TreeAttention creator, create the plugin from a
// PluginFieldCollection (build phase) and again from its own serialized fields (runtime phase), and
// query outputs, types, shapes and format support, in both node forms: 6 inputs (one [N, W] mask shared
// by the batch, every prefix row visible) and 7 (per-request [B, N, W] masks plus past_lengths [B]). When
// a CUDA device is present it also runs enqueue() on a small GQA tree problem in both forms (NaN in the
// padding prefix rows of the batched one) and compares with a CPU reference. Prints PASS and exits 0.
//
// Usage: tree_attention_smoke_test /path/to/libjetflow_trt_plugins.so
#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace {

int gFailures = 0;

void check(bool ok, char const* what)
{
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
    gFailures += ok ? 0 : 1;
}

class StderrLogger final : public ILogger {
public:
    void log(Severity severity, AsciiChar const* msg) noexcept override
    {
        std::fprintf(stderr, "[trt-log %d] %s\n", static_cast<int>(severity), msg);
    }
};

class Finder final : public ILoggerFinder {
public:
    ILogger* findLogger() override { return &mLogger; }

private:
    StderrLogger mLogger;
};

// Stand-ins for TensorRT's symbolic dimensions: the plugin only copies these pointers around.
struct FakeExpr final : IDimensionExpr {};
struct FakeBuilder final : IExprBuilder {};

struct PluginDeleter {
    void operator()(IPluginV3* p) const { delete p; }
};
using PluginPtr = std::unique_ptr<IPluginV3, PluginDeleter>;

Dims makeDims(std::vector<int64_t> const& sizes)
{
    Dims d{};
    d.nbDims = static_cast<int32_t>(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) {
        d.d[i] = sizes[i];
    }
    return d;
}

// Problem used throughout: B=2, Hq=4, Hkv=2 (GQA), N=40 tree nodes (two mask words), P=5, d=64.
constexpr int32_t kB = 2, kHq = 4, kHkv = 2, kN = 40, kP = 5, kD = 64, kW = (kN + 31) / 32;
constexpr int32_t kPastLengths[kB] = {5, 2};  // the batched form: request 1 has 3 padding prefix rows

// The shared form (6 inputs) or the batched one (7 inputs: [B, N, W] masks and past_lengths [B]).
std::vector<Dims> problemDims(int32_t kvHeads = kHkv, bool batched = false)
{
    std::vector<Dims> dims = {makeDims({kB, kHq, kN, kD}),      makeDims({kB, kvHeads, kP, kD}),
                              makeDims({kB, kvHeads, kP, kD}), makeDims({kB, kvHeads, kN, kD}),
                              makeDims({kB, kvHeads, kN, kD}), batched ? makeDims({kB, kN, kW}) : makeDims({kN, kW})};
    if (batched) {
        dims.push_back(makeDims({kB}));
    }
    return dims;
}

bool isIndexInput(size_t i)
{
    return i == 5 || i == 6;  // packed_mask, past_lengths
}

std::vector<DynamicPluginTensorDesc> dynamicDescs(std::vector<Dims> const& dims, DataType type)
{
    std::vector<DynamicPluginTensorDesc> descs(dims.size() + 1);
    for (size_t i = 0; i <= dims.size(); ++i) {
        Dims const& d = i < dims.size() ? dims[i] : dims[0];  // last entry: the output
        descs[i].desc.dims = d;
        descs[i].desc.type = i < dims.size() && isIndexInput(i) ? DataType::kINT32 : type;
        descs[i].desc.format = TensorFormat::kLINEAR;
        descs[i].desc.scale = 1.f;
        descs[i].min = descs[i].max = descs[i].opt = d;
    }
    return descs;
}

// Random tree over N nodes (parent < child), ancestor-or-self packed mask [N, W] (bit 31 set in the
// rows of node 31's descendants).
std::vector<int32_t> treeMask(std::mt19937& rng)
{
    std::vector<int32_t> parent(kN, -1);
    std::vector<uint32_t> words(static_cast<size_t>(kN) * kW, 0u);
    for (int32_t i = 0; i < kN; ++i) {
        parent[i] = i == 0 ? -1 : static_cast<int32_t>(rng() % static_cast<uint32_t>(i));
        for (int32_t a = i; a >= 0; a = parent[a]) {
            words[static_cast<size_t>(i) * kW + a / 32] |= 1u << (a % 32);
        }
    }
    std::vector<int32_t> mask(words.size());
    std::memcpy(mask.data(), words.data(), words.size() * sizeof(uint32_t));
    return mask;
}

// Straightforward double-precision reference of the contract. `mask` holds one [N, W] mask (shared) or
// kB of them (per request); `lengths` is past_lengths or null (every prefix row visible).
std::vector<float> reference(std::vector<float> const& q, std::vector<float> const& pk, std::vector<float> const& pv,
                             std::vector<float> const& k, std::vector<float> const& v,
                             std::vector<int32_t> const& mask, int32_t const* lengths, float scale)
{
    std::vector<float> out(q.size());
    size_t const maskStride = mask.size() == static_cast<size_t>(kN) * kW ? 0 : static_cast<size_t>(kN) * kW;
    for (int32_t b = 0; b < kB; ++b) {
        int32_t const past = lengths != nullptr ? lengths[b] : kP;
        for (int32_t h = 0; h < kHq; ++h) {
            int32_t const g = h / (kHq / kHkv);
            for (int32_t i = 0; i < kN; ++i) {
                float const* qi = &q[((static_cast<size_t>(b) * kHq + h) * kN + i) * kD];
                std::vector<double> scores;
                std::vector<float const*> values;
                auto add = [&](float const* kr, float const* vr) {
                    double s = 0;
                    for (int32_t c = 0; c < kD; ++c) {
                        s += static_cast<double>(qi[c]) * kr[c];
                    }
                    scores.push_back(s * scale);
                    values.push_back(vr);
                };
                for (int32_t j = 0; j < past; ++j) {
                    size_t const off = ((static_cast<size_t>(b) * kHkv + g) * kP + j) * kD;
                    add(&pk[off], &pv[off]);
                }
                for (int32_t t = 0; t < kN; ++t) {
                    uint32_t const word =
                        static_cast<uint32_t>(mask[b * maskStride + static_cast<size_t>(i) * kW + t / 32]);
                    if ((word >> (t % 32)) & 1u) {
                        size_t const off = ((static_cast<size_t>(b) * kHkv + g) * kN + t) * kD;
                        add(&k[off], &v[off]);
                    }
                }
                double m = -INFINITY;
                for (double s : scores) {
                    m = std::max(m, s);
                }
                double sum = 0;
                std::vector<double> acc(kD, 0.0);
                for (size_t j = 0; j < scores.size(); ++j) {
                    double const p = std::exp(scores[j] - m);
                    sum += p;
                    for (int32_t c = 0; c < kD; ++c) {
                        acc[c] += p * values[j][c];
                    }
                }
                float* oi = &out[((static_cast<size_t>(b) * kHq + h) * kN + i) * kD];
                for (int32_t c = 0; c < kD; ++c) {
                    oi[c] = static_cast<float>(acc[c] / sum);
                }
            }
        }
    }
    return out;
}

// Runs enqueue() in fp32 on the device and compares with the CPU reference: the shared form, or the
// batched one with per-request masks, past_lengths and NaN in every padding prefix row.
void checkEnqueueOnDevice(IPluginV3OneRuntime* runtime, float scale, bool batched)
{
    std::mt19937 rng(0);
    std::normal_distribution<float> normal(0.f, 1.f);
    auto randomVector = [&](size_t n) {
        std::vector<float> x(n);
        for (float& e : x) {
            e = normal(rng);
        }
        return x;
    };
    std::vector<std::vector<float>> host = {randomVector(size_t{kB} * kHq * kN * kD), randomVector(size_t{kB} * kHkv * kP * kD),
                                            randomVector(size_t{kB} * kHkv * kP * kD), randomVector(size_t{kB} * kHkv * kN * kD),
                                            randomVector(size_t{kB} * kHkv * kN * kD)};
    std::vector<int32_t> mask = treeMask(rng);
    if (batched) {  // a different tree per request, and padding prefix rows that must never be read
        std::vector<int32_t> const second = treeMask(rng);
        mask.insert(mask.end(), second.begin(), second.end());
        for (int32_t b = 0; b < kB; ++b) {
            for (int32_t g = 0; g < kHkv; ++g) {
                for (int32_t j = kPastLengths[b]; j < kP; ++j) {
                    for (int32_t c = 0; c < kD; ++c) {
                        size_t const off = ((static_cast<size_t>(b) * kHkv + g) * kP + j) * kD + c;
                        host[1][off] = host[2][off] = std::nanf("");
                    }
                }
            }
        }
    }
    int32_t const nbInputs = batched ? 7 : 6;
    std::vector<void*> device(8, nullptr);  // 7 inputs at most, then the output
    bool ok = true;
    for (size_t i = 0; i < 5; ++i) {
        ok = ok && cudaMalloc(&device[i], host[i].size() * sizeof(float)) == cudaSuccess
             && cudaMemcpy(device[i], host[i].data(), host[i].size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess;
    }
    ok = ok && cudaMalloc(&device[5], mask.size() * sizeof(int32_t)) == cudaSuccess
         && cudaMemcpy(device[5], mask.data(), mask.size() * sizeof(int32_t), cudaMemcpyHostToDevice) == cudaSuccess;
    if (batched) {
        ok = ok && cudaMalloc(&device[6], sizeof(kPastLengths)) == cudaSuccess
             && cudaMemcpy(device[6], kPastLengths, sizeof(kPastLengths), cudaMemcpyHostToDevice) == cudaSuccess;
    }
    ok = ok && cudaMalloc(&device[7], host[0].size() * sizeof(float)) == cudaSuccess;
    check(ok, "device buffers allocated");
    if (ok) {
        std::vector<Dims> const dims = problemDims(kHkv, batched);
        std::vector<PluginTensorDesc> in(dims.size());
        for (size_t i = 0; i < dims.size(); ++i) {
            in[i].dims = dims[i];
            in[i].type = isIndexInput(i) ? DataType::kINT32 : DataType::kFLOAT;
            in[i].format = TensorFormat::kLINEAR;
            in[i].scale = 1.f;
        }
        PluginTensorDesc out = in[0];
        check(runtime->onShapeChange(in.data(), nbInputs, &out, 1) == 0, "onShapeChange accepts the problem");
        void const* inputs[7] = {device[0], device[1], device[2], device[3], device[4], device[5], device[6]};
        void* outputs[1] = {device[7]};
        int32_t const status = runtime->enqueue(in.data(), &out, inputs, outputs, nullptr, nullptr);
        check(status == 0 && cudaDeviceSynchronize() == cudaSuccess, "enqueue runs (fp32)");
        std::vector<float> got(host[0].size());
        cudaMemcpy(got.data(), device[7], got.size() * sizeof(float), cudaMemcpyDeviceToHost);
        std::vector<float> const want =
            reference(host[0], host[1], host[2], host[3], host[4], mask, batched ? kPastLengths : nullptr, scale);
        double maxErr = 0;
        bool finite = true;
        for (size_t i = 0; i < got.size(); ++i) {
            finite = finite && std::isfinite(got[i]);
            maxErr = std::max(maxErr, static_cast<double>(std::fabs(got[i] - want[i])));
        }
        std::printf("     max |plugin - reference| = %.3g (%s)\n", maxErr, batched ? "batched" : "shared mask");
        check(finite && maxErr < 1e-4, "enqueue matches the CPU reference (fp32, atol 1e-4), all finite");
    }
    for (void* p : device) {
        cudaFree(p);
    }
}

}  // namespace

int main(int argc, char** argv)
{
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s /path/to/libjetflow_trt_plugins.so\n", argv[0]);
        return 2;
    }
    void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
        std::fprintf(stderr, "dlopen failed: %s\n", dlerror());
        return 1;
    }
    using SetLoggerFinderFn = void (*)(ILoggerFinder*);
    using GetCreatorsFn = IPluginCreatorInterface* const* (*)(int32_t&);
    auto setLoggerFinder = reinterpret_cast<SetLoggerFinderFn>(dlsym(lib, "setLoggerFinder"));
    auto getCreators = reinterpret_cast<GetCreatorsFn>(dlsym(lib, "getCreators"));
    check(setLoggerFinder != nullptr, "exports setLoggerFinder");
    check(getCreators != nullptr, "exports getCreators");
    if (setLoggerFinder == nullptr || getCreators == nullptr) {
        return 1;
    }
    static Finder finder;
    setLoggerFinder(&finder);

    int32_t nbCreators = 0;
    IPluginCreatorInterface* const* creators = getCreators(nbCreators);
    IPluginCreatorV3One* creator = nullptr;
    for (int32_t i = 0; i < nbCreators; ++i) {
        if (std::strcmp(creators[i]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0) {
            auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
            if (std::strcmp(c->getPluginName(), "TreeAttention") == 0) {
                creator = c;
            }
        }
    }
    check(creator != nullptr, "getCreators lists a V3One creator named TreeAttention");
    if (creator == nullptr) {
        return 1;
    }
    check(std::strcmp(creator->getPluginVersion(), "1") == 0, "creator version is \"1\"");
    check(std::strcmp(creator->getPluginNamespace(), "") == 0, "creator namespace is \"\"");
    PluginFieldCollection const* names = creator->getFieldNames();
    int found = 0;
    for (int32_t i = 0; names != nullptr && i < names->nbFields; ++i) {
        for (char const* want : {"num_heads", "num_kv_heads", "head_size", "scale"}) {
            found += std::strcmp(names->fields[i].name, want) == 0 ? 1 : 0;
        }
    }
    check(found == 4, "getFieldNames declares num_heads, num_kv_heads, head_size, scale");

    // Build phase: fields as the ONNX parser passes them (ints here as int64 to exercise the widening).
    int64_t const numHeads = kHq, numKvHeads = kHkv, headSize = kD;
    float const scale = 0.125f;
    char const version[] = "1";
    std::vector<PluginField> fields = {
        {"num_heads", &numHeads, PluginFieldType::kINT64, 1},
        {"num_kv_heads", &numKvHeads, PluginFieldType::kINT64, 1},
        {"head_size", &headSize, PluginFieldType::kINT64, 1},
        {"scale", &scale, PluginFieldType::kFLOAT32, 1},
        {"plugin_version", version, PluginFieldType::kCHAR, 1},
    };
    PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
    PluginPtr plugin(creator->createPlugin("tree_attention_0", &fc, TensorRTPhase::kBUILD));
    check(plugin != nullptr, "createPlugin(kBUILD) from fields");
    if (!plugin) {
        return 1;
    }
    int64_t const badHeadSize = 96;
    fields[2].data = &badHeadSize;
    PluginPtr bad(creator->createPlugin("bad", &fc, TensorRTPhase::kBUILD));
    check(bad == nullptr, "createPlugin rejects head_size 96 (an error log line above is expected)");
    fields[2].data = &headSize;

    auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    check(core != nullptr && build != nullptr && runtime != nullptr, "core, build and runtime capabilities");
    if (core == nullptr || build == nullptr || runtime == nullptr) {
        return 1;
    }
    check(std::strcmp(core->getPluginName(), "TreeAttention") == 0 && std::strcmp(core->getPluginVersion(), "1") == 0,
          "core reports TreeAttention v1");
    check(build->getNbOutputs() == 1, "one output");

    for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16}) {
        DataType const inTypes[6] = {t, t, t, t, t, DataType::kINT32};
        DataType outType = DataType::kINT8;
        check(build->getOutputDataTypes(&outType, 1, inTypes, 6) == 0 && outType == t, "output type = query type");
        std::vector<DynamicPluginTensorDesc> descs = dynamicDescs(problemDims(), t);
        bool all = true;
        for (int32_t pos = 0; pos < 7; ++pos) {
            all = all && build->supportsFormatCombination(pos, descs.data(), 6, 1);
        }
        check(all, "supportsFormatCombination: float type everywhere + int32 mask");
        check(build->configurePlugin(descs.data(), 6, descs.data() + 6, 1) == 0, "configurePlugin accepts the problem");
    }
    std::vector<DynamicPluginTensorDesc> descs = dynamicDescs(problemDims(), DataType::kHALF);
    descs[0].desc.type = DataType::kINT8;
    check(!build->supportsFormatCombination(0, descs.data(), 6, 1), "rejects an int8 query");
    descs[0].desc.type = DataType::kHALF;
    descs[3].desc.type = DataType::kFLOAT;
    check(!build->supportsFormatCombination(3, descs.data(), 6, 1), "rejects a key type different from the query");
    descs[3].desc.type = DataType::kHALF;
    descs[5].desc.type = DataType::kHALF;
    check(!build->supportsFormatCombination(5, descs.data(), 6, 1), "rejects a non-int32 mask");
    descs[5].desc.type = DataType::kINT32;
    descs[1].desc.format = TensorFormat::kCHW2;
    check(!build->supportsFormatCombination(1, descs.data(), 6, 1), "rejects a non-linear format");
    std::vector<DynamicPluginTensorDesc> wrongHeads = dynamicDescs(problemDims(3), DataType::kHALF);
    check(build->configurePlugin(wrongHeads.data(), 6, wrongHeads.data() + 6, 1) != 0,
          "configurePlugin rejects 3 KV heads when num_kv_heads is 2 (an error log line above is expected)");

    // The batched form: [B, N, W] masks and past_lengths [B] (7 inputs; the output is position 7).
    for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16}) {
        DataType const inTypes[7] = {t, t, t, t, t, DataType::kINT32, DataType::kINT32};
        DataType outType = DataType::kINT8;
        check(build->getOutputDataTypes(&outType, 1, inTypes, 7) == 0 && outType == t,
              "batched: output type = query type");
        std::vector<DynamicPluginTensorDesc> batchedDescs = dynamicDescs(problemDims(kHkv, true), t);
        bool all = true;
        for (int32_t pos = 0; pos < 8; ++pos) {
            all = all && build->supportsFormatCombination(pos, batchedDescs.data(), 7, 1);
        }
        check(all, "batched: supportsFormatCombination: float type everywhere + int32 mask and past_lengths");
        check(build->configurePlugin(batchedDescs.data(), 7, batchedDescs.data() + 7, 1) == 0,
              "batched: configurePlugin accepts [B, N, W] masks and past_lengths [B]");
    }
    std::vector<DynamicPluginTensorDesc> batchedDescs = dynamicDescs(problemDims(kHkv, true), DataType::kHALF);
    batchedDescs[6].desc.type = DataType::kINT64;
    check(!build->supportsFormatCombination(6, batchedDescs.data(), 7, 1), "batched: rejects int64 past_lengths");
    batchedDescs[6].desc.type = DataType::kINT32;
    batchedDescs[7].desc.type = DataType::kINT32;
    check(!build->supportsFormatCombination(7, batchedDescs.data(), 7, 1),
          "batched: the output (position 7) must follow the query type");
    batchedDescs[7].desc.type = DataType::kHALF;
    check(!build->supportsFormatCombination(0, batchedDescs.data(), 8, 1), "rejects 8 inputs");
    batchedDescs[6].desc.dims = makeDims({kB + 1});
    check(build->configurePlugin(batchedDescs.data(), 7, batchedDescs.data() + 7, 1) != 0,
          "batched: configurePlugin rejects past_lengths [B + 1] (an error log line above is expected)");
    batchedDescs[6].desc.dims = makeDims({kB});
    batchedDescs[5].desc.dims = makeDims({kB + 1, kN, kW});
    check(build->configurePlugin(batchedDescs.data(), 7, batchedDescs.data() + 7, 1) != 0,
          "batched: configurePlugin rejects a [B + 1, N, W] mask (an error log line above is expected)");
    batchedDescs[5].desc.dims = makeDims({kB, kN, kW - 1});
    check(build->configurePlugin(batchedDescs.data(), 7, batchedDescs.data() + 7, 1) != 0,
          "batched: configurePlugin rejects too few mask words (an error log line above is expected)");

    FakeExpr exprs[4];
    FakeBuilder builder;
    DimsExprs inShapes[6]{};
    for (DimsExprs& s : inShapes) {
        s.nbDims = 4;
        for (int32_t i = 0; i < 4; ++i) {
            s.d[i] = &exprs[i];
        }
    }
    inShapes[5].nbDims = 2;
    for (int32_t nbInputs : {6, 7}) {
        DimsExprs shapes[7];
        std::copy(inShapes, inShapes + 6, shapes);
        shapes[5].nbDims = nbInputs == 7 ? 3 : 2;  // [B, N, W] masks in the batched form
        shapes[6] = inShapes[5];
        shapes[6].nbDims = 1;  // past_lengths [B]
        DimsExprs outShape{};
        bool const shapeOk = build->getOutputShapes(shapes, nbInputs, nullptr, 0, &outShape, 1, builder) == 0;
        bool same = shapeOk && outShape.nbDims == 4;
        for (int32_t i = 0; same && i < 4; ++i) {
            same = outShape.d[i] == shapes[0].d[i];
        }
        check(same, nbInputs == 6 ? "getOutputShapes returns the query's shape"
                                  : "batched: getOutputShapes returns the query's shape");
    }

    // Runtime phase: recreate from the serialized fields, as engine deserialization does.
    PluginFieldCollection const* serial = runtime->getFieldsToSerialize();
    PluginPtr restored(serial != nullptr ? creator->createPlugin("tree_attention_0", serial, TensorRTPhase::kRUNTIME)
                                         : nullptr);
    check(restored != nullptr, "createPlugin(kRUNTIME) from getFieldsToSerialize()");
    PluginPtr cloned(plugin->clone());
    check(cloned != nullptr, "clone()");
    PluginPtr attached(runtime->attachToContext(nullptr));
    check(attached != nullptr, "attachToContext()");

    int deviceCount = 0;
    if (cudaGetDeviceCount(&deviceCount) == cudaSuccess && deviceCount > 0 && restored) {
        auto* restoredRuntime =
            static_cast<IPluginV3OneRuntime*>(restored->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        checkEnqueueOnDevice(restoredRuntime, scale, false);
        PluginPtr batchedPlugin(restored->clone());  // a fresh instance for the 7-input node
        auto* batchedRuntime =
            static_cast<IPluginV3OneRuntime*>(batchedPlugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        checkEnqueueOnDevice(batchedRuntime, scale, true);
    } else {
        std::printf("skip enqueue numerics: no CUDA device\n");
    }

    plugin.reset();
    restored.reset();
    cloned.reset();
    attached.reset();
    if (gFailures != 0) {
        std::printf("FAILED (%d checks)\n", gFailures);
        return 1;
    }
    std::printf("PASS\n");
    return 0;
}
