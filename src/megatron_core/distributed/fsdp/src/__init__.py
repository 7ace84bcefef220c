"""Megatron-FSDP as a standalone package (Megatron-Core 0.19's ``megatron.core.distributed.fsdp.src``).

The package itself is :mod:`megatron_core.distributed.fsdp.src.megatron_fsdp`: ``fully_shard`` for any
``torch.nn.Module``, served here by PyTorch FSDP2.
"""
