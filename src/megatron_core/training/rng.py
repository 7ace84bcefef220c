"""Every random number generator state a training step depends on, as plain data.

Python ``random``, NumPy, torch CPU, the accelerator's default generator and the tensor-parallel
RNG tracker (``model-parallel-rng`` and friends). The NumPy state is stored as a tuple of plain
values and a tensor so the checkpoint loads with ``torch.load(weights_only=True)``.

In a checkpoint the states form Megatron-LM's ``rng_state`` ShardedObject on a (pp, tp) grid, so
they only load under the same tensor/pipeline layout (the caller skips them otherwise).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from megatron_core import device, parallel_state
from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.mapping import ShardedObject
from megatron_core.tensor_parallel.random import get_cuda_rng_tracker

RNG_KEY = "rng_state"


def get_rng_state() -> dict[str, Any]:
    """This process's RNG states."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": (str(kind), torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
                         int(pos), int(has_gauss), float(cached)),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": device.get_device_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states taken by :func:`get_rng_state`."""
    random.setstate(state["random_rng_state"])
    kind, keys, pos, has_gauss, cached = state["np_rng_state"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_rng_state"])
    device.set_device_rng_state(state["cuda_rng_state"])
    get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _layout() -> tuple[int, int, int, int, int, Any]:
    """``(pp_rank, pp_size, tp_rank, tp_size, dp_rank, dp_group)``; without parallel_state every rank is DP."""
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, 0, 1, collectives.get_rank(), None
    return (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_data_parallel_rank(with_context_parallel=True),
            parallel_state.get_data_parallel_group(with_context_parallel=True))


def sharded_rng_state(for_loading: bool = False) -> ShardedObject:
    """This rank's RNG states as Megatron-LM stores them: ``rng_state`` on a (pp, tp) grid.

    The payload is the list of every data-parallel rank's states (gathered over the DP group), so
    each DP replica resumes with its own generators; DP rank 0 writes it. ``for_loading``
    builds the request without gathering any states.
    """
    pp_rank, pp, tp_rank, tp, dp_rank, dp_group = _layout()
    data = None if for_loading else collectives.all_gather_object(get_rng_state(), dp_group)
    return ShardedObject(RNG_KEY, data, (pp, tp), (pp_rank, tp_rank), replica_id=dp_rank)


def restore_sharded_rng_state(states: list[dict[str, Any]]) -> bool:
    """Restore this DP rank's entry of a loaded ``rng_state`` list; ``False`` when the DP size changed."""
    _, _, _, _, dp_rank, dp_group = _layout()
    compatible = isinstance(states, list) and len(states) == collectives.get_world_size(dp_group)
    if compatible:
        set_rng_state(states[dp_rank])
    return compatible
