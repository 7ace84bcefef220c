"""Building a TensorRT-LLM engine from converted weights (Megatron-Core's ``engine_builder``)."""
