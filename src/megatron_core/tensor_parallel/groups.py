"""Which process group a tensor-parallel operation uses, and its size and rank.

Every layer and mapping takes an explicit group; ``None`` means the tensor-parallel group (or the
expert tensor-parallel group for expert layers) found by the package's one resolver,
:func:`megatron_core.process_groups_config.resolve_process_group`: ``pg_collection`` when given,
else ``parallel_state``. When no group is registered at all (a single process without
``initialize_model_parallel``), the operation runs with a tensor-parallel size of 1 and every
collective is the identity. Sizes and ranks come from :func:`megatron_core._ground.get_pg_size` / ``get_pg_rank``.
:func:`resolve_tp_group` and ``get_tensor_model_parallel_group_if_none`` (Megatron-Core's helper) are
defined next to that resolver in ``process_groups_config`` and re-exported here, where the layers import them.
"""

from __future__ import annotations

from megatron_core.process_groups_config import get_tensor_model_parallel_group_if_none, resolve_tp_group

__all__ = ["get_tensor_model_parallel_group_if_none", "resolve_tp_group"]
