"""Data parallelism: bucketed gradient reduction (``DistributedDataParallel``) and ``finalize_model_grads``."""

from megatron_core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_core.distributed.finalize_model_grads import finalize_model_grads
from megatron_core.distributed.param_and_grad_buffer import partition_buckets

__all__ = [
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "finalize_model_grads",
    "partition_buckets",
]
