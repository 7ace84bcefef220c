"""Training-state checkpoints for training loops (Megatron-LM's ``checkpointing.py`` on ``dist_checkpointing``).

:func:`save_checkpoint` writes model chunks, optimizer, scheduler, RNG states, iteration,
consumed samples and extra plain data into ``<save_dir>/iter_0000010/`` and then moves the
``latest_checkpointed_iteration.txt`` tracker; :func:`load_checkpoint` restores them under any
parallel layout. See ``docs/dist_checkpointing.md``.
"""

from megatron_core.dist_checkpointing.training.checkpointing import (
    CHECKPOINT_VERSION,
    load_checkpoint,
    load_optimizer_state,
    optimizer_sharded_state_dict,
    save_checkpoint,
    unwrap_model_chunks,
)
from megatron_core.dist_checkpointing.training.rng import get_rng_state, set_rng_state
from megatron_core.dist_checkpointing.training.tracker import (
    TRACKER_FILENAME,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    read_tracker,
    write_tracker,
)

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
