"""Megatron-FSDP's standalone API (Megatron-Core 0.19's ``megatron_fsdp`` package) on PyTorch FSDP2.

``fully_shard(module, optimizer, ...)`` shards any ``torch.nn.Module`` with Megatron-FSDP's arguments and
returns ``(MegatronFSDP model, optimizer)``; the sharding runtime is PyTorch's ``fully_shard`` (FSDP2).
See ``fully_shard.py`` for what is served and what is refused.
"""

from megatron_core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_core.distributed.fsdp.src.megatron_fsdp.fully_shard import (
    ShardingStrategy,
    experimental_api,
    fully_shard,
    fully_shard_model,
    fully_shard_optimizer,
)
from megatron_core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP, TrainingState
from megatron_core.distributed.fsdp.src.megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_core.distributed.fsdp.src.megatron_fsdp.package_info import (
    __contact_emails__,
    __contact_names__,
    __description__,
    __download_url__,
    __homepage__,
    __keywords__,
    __license__,
    __package_name__,
    __repository_url__,
    __shortversion__,
    __version__,
)
from megatron_core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex

__all__ = [
    "DistributedDataParallelConfig",
    "FSDPDistributedIndex",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "ShardingStrategy",
    "TrainingState",
    "experimental_api",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "__contact_emails__",
    "__contact_names__",
    "__description__",
    "__download_url__",
    "__homepage__",
    "__keywords__",
    "__license__",
    "__package_name__",
    "__repository_url__",
    "__shortversion__",
    "__version__",
]
