"""Model Optimizer's hybrid (Mamba) stack spec (Megatron-Core's ``post_training.modelopt.hybrid``)."""
