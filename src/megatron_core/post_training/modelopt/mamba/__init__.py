"""Megatron-Core's earlier home of the hybrid stack spec for Model Optimizer (``post_training.modelopt.mamba``)."""
