"""Training-run checkpoints at their former path; the code lives in :mod:`megatron_core.training`
(the training-loop layer) and :mod:`megatron_core.dist_checkpointing.tracker`."""


from megatron_core.dist_checkpointing.tracker import (
    TRACKER_FILENAME,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    read_tracker,
    write_tracker,
)
from megatron_core.training.checkpointing import (
    CHECKPOINT_VERSION,
    load_checkpoint,
    load_optimizer_state,
    optimizer_sharded_state_dict,
    save_checkpoint,
    unwrap_model_chunks,
)
from megatron_core.training.rng import get_rng_state, set_rng_state

__all__ = [
    "CHECKPOINT_VERSION",
    "TRACKER_FILENAME",
    "get_checkpoint_name",
    "get_checkpoint_tracker_filename",
    "get_rng_state",
    "load_checkpoint",
    "load_optimizer_state",
    "optimizer_sharded_state_dict",
    "read_tracker",
    "save_checkpoint",
    "set_rng_state",
    "unwrap_model_chunks",
    "write_tracker",
]
