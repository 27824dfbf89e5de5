"""Stage 3: ONNX graphs and TensorRT engines for the draft head and the target verify step."""
