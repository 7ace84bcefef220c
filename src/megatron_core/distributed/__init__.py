"""Data parallelism: bucketed gradient reduction (``DistributedDataParallel``), FSDP2 sharding
(``TorchFullyShardedDataParallel``), Megatron-FSDP's entry point (``FullyShardedDataParallel``) and
``finalize_model_grads``."""

from megatron_core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_core.distributed.finalize_model_grads import finalize_model_grads
from megatron_core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron_core.distributed.param_and_grad_buffer import partition_buckets
from megatron_core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
from megatron_core.distributed.torch_fully_sharded_data_parallel_config import (
    TorchFullyShardedDataParallelConfig,
)

__all__ = [
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "FullyShardedDataParallel",
    "TorchFullyShardedDataParallel",
    "TorchFullyShardedDataParallelConfig",
    "finalize_model_grads",
    "partition_buckets",
]
