"""Training-run checkpoints: save and load of a run (model chunks, optimizer, scheduler, RNG, iteration).

The training-loop layer of ``megatron_core`` (above models and optimizer); Megatron-LM keeps this in
``megatron/training``. :func:`save_checkpoint` writes ``<save_dir>/iter_0000010/`` and then moves the
``latest_checkpointed_iteration.txt`` tracker (:mod:`megatron_core.dist_checkpointing.tracker`);
:func:`load_checkpoint` restores a run under any parallel layout. :func:`get_model` builds a rank's
model chunks. See ``docs/dist_checkpointing.md`` and ``docs/architecture.md``.
"""


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
from megatron_core.training.model_builder import configure_model_hooks, get_model
from megatron_core.training.rng import get_rng_state, set_rng_state

__all__ = [
    "CHECKPOINT_VERSION",
    "TRACKER_FILENAME",
    "configure_model_hooks",
    "get_checkpoint_name",
    "get_checkpoint_tracker_filename",
    "get_model",
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
