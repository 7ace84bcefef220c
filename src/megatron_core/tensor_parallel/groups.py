"""Which process group a tensor-parallel operation uses, and its size and rank.

Every layer and mapping takes an explicit group; ``None`` means the tensor-parallel group (or the
expert tensor-parallel group for expert layers) found by the package's one resolver,
:func:`megatron_core.process_groups_config.resolve_process_group`: ``pg_collection`` when given,
else ``parallel_state``. When no group is registered at all (a single process without
``initialize_model_parallel``), the operation runs with a tensor-parallel size of 1 and every
collective is the identity. Sizes and ranks come from :func:`megatron_core.utils.get_pg_size` / ``get_pg_rank``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.process_groups_config import resolve_process_group

__all__ = ["get_tensor_model_parallel_group_if_none", "resolve_tp_group"]


def get_tensor_model_parallel_group_if_none(
    tp_group: dist.ProcessGroup | None, is_expert: bool = False, check_initialized: bool = False
) -> dist.ProcessGroup | None:
    """``tp_group`` if given, else the (expert) tensor-parallel group from ``parallel_state``.

    Returns ``None`` when no group is registered and ``check_initialized`` is False; such a
    group behaves as a group of one process.
    """
    group = resolve_process_group("expt_tp" if is_expert else "tp", group=tp_group)
    if group is None and check_initialized:
        # Raises the "not initialized" error of parallel_state.
        if is_expert:
            parallel_state.get_expert_tensor_parallel_group(check_initialized=True)
        else:
            parallel_state.get_tensor_model_parallel_group(check_initialized=True)
    return group


def resolve_tp_group(tp_group: Any = None, pg_collection: Any = None, is_expert: bool = False) -> Any:
    """The (expert) TP group: ``tp_group``, else ``pg_collection.tp`` / ``.expt_tp``, else ``parallel_state``."""
    return resolve_process_group("expt_tp" if is_expert else "tp", pg_collection=pg_collection, group=tp_group)
