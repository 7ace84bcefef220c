"""Megatron-FSDP's entry point (Megatron-Core 0.19's ``megatron.core.distributed.fsdp``).

:class:`FullyShardedDataParallel` takes 0.19's constructor and methods and serves each
``data_parallel_sharding_strategy`` with the library's own wrappers (``mcore_fsdp_adapter``).
"""

from megatron_core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel"]
