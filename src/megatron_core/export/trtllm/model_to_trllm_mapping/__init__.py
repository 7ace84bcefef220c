"""Megatron state-dict keys -> TensorRT-LLM weight names (Megatron-Core's ``model_to_trllm_mapping``)."""
