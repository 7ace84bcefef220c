"""``TorchFullyShardedDataParallelConfig``: settings of :class:`TorchFullyShardedDataParallel` (PyTorch FSDP2).

Mirrors Megatron-Core's dataclass of the same name: a ``DistributedDataParallelConfig`` plus
``reshard_after_forward``. FSDP2 shards parameters, gradients and optimizer state itself, so the
bucketed-DDP options that describe Megatron's own buffers have no effect, and the combinations
FSDP cannot serve are rejected here with a ``ValueError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig


@dataclass
class TorchFullyShardedDataParallelConfig(DistributedDataParallelConfig):
    """Configuration for :class:`~megatron_core.distributed.TorchFullyShardedDataParallel`."""

    reshard_after_forward: bool | int = True
    """Free the all-gathered parameters after each sharded module's forward (re-gather in backward).

    ``False`` keeps them until backward (more memory, one all-gather less); an int reshards to a
    smaller group of that size (PyTorch's ``fully_shard`` semantics).
    """

    def __post_init__(self) -> None:
        """Validate; FSDP2 has its own sharding, so Megatron's distributed optimizer cannot be combined."""
        super().__post_init__()
        if self.use_distributed_optimizer:
            raise ValueError(
                "use_distributed_optimizer=True cannot be combined with TorchFullyShardedDataParallel: FSDP2 "
                "already shards the optimizer state (set use_distributed_optimizer=False)"
            )
        if isinstance(self.reshard_after_forward, bool):
            return
        if not isinstance(self.reshard_after_forward, int) or self.reshard_after_forward < 1:
            raise ValueError(
                f"reshard_after_forward ({self.reshard_after_forward!r}) must be a bool or a positive int"
            )
