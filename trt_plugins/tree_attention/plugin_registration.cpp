// The two C entry points TensorRT looks up when it loads a plugin library (IPluginRegistry::loadLibrary,
// trtexec --dynamicPlugins, the ONNX parser's plugin search). Exposing creators this way, rather than
// calling getPluginRegistry()->registerCreator(), is what lets the .so link without libnvinfer.
#include <cstdint>

#include "tree_attention_plugin.h"

#define JETFLOW_PLUGIN_EXPORT __attribute__((visibility("default")))

extern "C" {

//! Called by TensorRT before getCreators; the finder yields TensorRT's logger for our error messages.
JETFLOW_PLUGIN_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    jetflow::trt::setPluginLoggerFinder(finder);
}

//! Every creator this library provides (one: TreeAttention v1). The objects live as long as the library.
JETFLOW_PLUGIN_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static jetflow::trt::TreeAttentionPluginCreator treeAttentionCreator;
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&treeAttentionCreator};
    nbCreators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
    return creators;
}

}  // extern "C"
