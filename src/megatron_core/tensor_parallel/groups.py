"""Which process group a tensor-parallel operation uses, and its size and rank.

Every layer and mapping takes an explicit group; ``None`` means the tensor-parallel group (or the
expert tensor-parallel group for expert layers) registered in ``parallel_state``. When no group
is registered at all (a single process without ``initialize_model_parallel``), the operation
runs with a tensor-parallel size of 1 and every collective is the identity.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_core import parallel_state


def get_tensor_model_parallel_group_if_none(
    tp_group: dist.ProcessGroup | None, is_expert: bool = False, check_initialized: bool = False
) -> dist.ProcessGroup | None:
    """``tp_group`` if given, else the (expert) tensor-parallel group from ``parallel_state``.

    Returns ``None`` when no group is registered and ``check_initialized`` is False; such a
    group behaves as a group of one process.
    """
    if tp_group is not None:
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of processes in ``group``; 1 for ``None`` (no registered group)."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 for ``None`` (no registered group)."""
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)
