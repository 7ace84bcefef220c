"""Megatron weights -> TensorRT-LLM weights, on one device or on each model-parallel rank."""
