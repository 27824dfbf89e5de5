"""jetflow_pl: causal parallel draft heads (JetFlow) for lossless speculative decoding.

Stages: `data_gen` (regenerate data with the target) -> `jetflow_pl` (draft head, tree, distillation,
decode loop) -> `export` (ONNX / TensorRT) -> `trt_plugins` (the TreeAttention plugin).
Imports stay lazy here so `python -m jetflow_pl --help` starts fast.
"""

__version__ = "0.1.0"
