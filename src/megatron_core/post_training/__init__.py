"""Post-training of this library's models (Megatron-Core's ``megatron.core.post_training``).

:mod:`.modelopt` integrates NVIDIA Model Optimizer (``nvidia-modelopt``, the ``modelopt`` extra):
post-training quantization of a ``GPTModel`` built from this library's layers, its layer specs, and
quantized checkpoints through ``dist_checkpointing``. Importing this package never imports Model
Optimizer; only the functions that need it do.
"""
