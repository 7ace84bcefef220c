"""Which process group a tensor-parallel operation uses, and its size and rank.

Every layer and mapping takes an explicit group; ``None`` means the tensor-parallel group (or the
expert tensor-parallel group for expert layers) found by the package's one resolver,
:func:`megatron_core.process_groups_config.resolve_process_group`: ``pg_collection`` when given,
else ``parallel_state``. When no group is registered at all (a single process without
``initialize_model_parallel``), the operation runs with a tensor-parallel size of 1 and every
collective is the identity. Sizes and ranks come from :func:`megatron_core._ground.get_pg_size` / ``get_pg_rank``.
``get_tensor_model_parallel_group_if_none`` (Megatron-Core's helper, defined in ``process_groups_config``)
is re-exported here for older imports.
"""

from __future__ import annotations

from typing import Any

from megatron_core.process_groups_config import get_tensor_model_parallel_group_if_none, resolve_process_group

__all__ = ["get_tensor_model_parallel_group_if_none", "resolve_tp_group"]


def resolve_tp_group(tp_group: Any = None, pg_collection: Any = None, is_expert: bool = False) -> Any:
    """The (expert) TP group: ``tp_group``, else ``pg_collection.tp`` / ``.expt_tp``, else ``parallel_state``."""
    return resolve_process_group("expt_tp" if is_expert else "tp", pg_collection=pg_collection, group=tp_group)
