"""Sharded, reshardable, crash-safe checkpoints (Megatron-Core ``dist_checkpointing``).

Modules describe their state as a sharded state dict (:mod:`.mapping`): global keys plus each
rank's offset inside every global tensor. :func:`save` writes it with PyTorch Distributed
Checkpoint files; :func:`load` reads it back under any tensor/pipeline/data-parallel layout.
See ``docs/dist_checkpointing.md``.
"""

from megatron_core.dist_checkpointing.core import (
    CheckpointingConfig,
    CheckpointingException,
    check_is_distributed_checkpoint,
)
from megatron_core.dist_checkpointing.factories import (
    apply_fused_chunks_sharded_factory,
    apply_swiglu_sharded_factory,
)
from megatron_core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from megatron_core.dist_checkpointing.serialization import (
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from megatron_core.dist_checkpointing.sharded_module import (
    make_sharded_object_for_checkpoint,
    make_sharded_tensor_for_checkpoint,
    make_sharded_tensors_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
    sharded_state_dict_default,
    sharded_state_dict_for_layers,
)
from megatron_core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron_core.dist_checkpointing.validation import StrictHandling

__all__ = [
    "AsyncCallsQueue",
    "AsyncRequest",
    "CheckpointingConfig",
    "CheckpointingException",
    "LocalNonpersistentObject",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StrictHandling",
    "apply_factories",
    "apply_factory_merges",
    "apply_fused_chunks_sharded_factory",
    "apply_swiglu_sharded_factory",
    "check_is_distributed_checkpoint",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "make_sharded_object_for_checkpoint",
    "make_sharded_tensor_for_checkpoint",
    "make_sharded_tensors_for_checkpoint",
    "make_tp_sharded_tensor_for_checkpoint",
    "remove_sharded_tensors",
    "save",
    "sharded_state_dict_default",
    "sharded_state_dict_for_layers",
]
