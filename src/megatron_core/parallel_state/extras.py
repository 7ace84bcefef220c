"""Group helpers of Megatron-Core's ``parallel_state`` beyond the standard layout: ``create_group``,
``update_pg_timeout``, ``create_all_gather_groups``, ``destroy_global_memory_buffer`` and the per-group NCCL
communicator options (``get_nccl_options``, ``overwrite_nccl_comm_cfgs``)."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron_core import device
from megatron_core.parallel_state import registry as _ps

logger = logging.getLogger(__name__)

# Groups made through create_group (None stands for the default group).
_global_process_group_list: list[dist.ProcessGroup | None] | None = None


def create_group(ranks: list[int] | None = None, timeout: timedelta | None = None, backend: str | None = None,
                 pg_options: Any = None, use_local_synchronization: bool = False,
                 group_desc: str | None = None) -> dist.ProcessGroup:
    """``torch.distributed.new_group`` (a collective call), remembered for :func:`update_pg_timeout`."""
    global _global_process_group_list
    group = dist.new_group(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                           use_local_synchronization=use_local_synchronization, group_desc=group_desc)
    if _global_process_group_list is None:
        _global_process_group_list = [None]
    if ranks is None or dist.get_rank() in ranks:
        _global_process_group_list.append(group)
    return group


def update_pg_timeout(timeout: timedelta, pg: dist.ProcessGroup | None = None) -> None:
    """Set the collective timeout of ``pg`` (default: every group made by ``create_group`` and
    ``initialize_model_parallel``, and the default group), after a barrier on ``pg``."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        raise RuntimeError("this torch has no torch.distributed.distributed_c10d._set_pg_timeout")
    if not isinstance(timeout, timedelta):
        raise ValueError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    dist.barrier(pg)
    device.synchronize()
    if pg is not None:
        setter(timeout, pg)
        return
    groups = {id(g): g for g in (_global_process_group_list or [None]) if g is not None}
    groups.update({id(g): g for g in _ps._GROUPS.values() if g is not None})
    setter(timeout, None)
    for group in groups.values():
        setter(timeout, group)


def create_all_gather_groups(for_expert_parallelism: bool = False, timeout: timedelta | None = None,
                             nccl_comm_cfgs: dict | None = None) -> tuple[Any, Any]:
    """Second communicators over the DP x CP (and expert DP) ranks, so all-gathers can overlap reduce-scatters.

    Returns ``(dp_cp_ag_group, expt_dp_ag_group)`` (the second None unless ``for_expert_parallelism``);
    they are freed by ``destroy_model_parallel``.
    """
    if not _ps.is_initialized():
        raise RuntimeError("create_all_gather_groups() needs initialize_model_parallel() first")
    timeout = timeout or timedelta(minutes=30)
    _ps._new_group("dp_cp_ag", _ps._ALL_GROUP_RANKS["dp_cp"], timeout)
    expert = None
    if for_expert_parallelism:
        _ps._new_group("expt_dp_ag", _ps._ALL_GROUP_RANKS["expt_dp"], timeout)
        expert = _ps._GROUPS["expt_dp_ag"]
    return _ps._GROUPS["dp_cp_ag"], expert


def destroy_global_memory_buffer() -> None:
    """Drop the global memory buffer (``get_global_memory_buffer`` raises until the next initialisation)."""
    _ps._MEMORY_BUFFER.update(buffer=None, destroyed=True)


_NCCL_CONFIG_KEYS = ("cga_cluster_size", "max_ctas", "min_ctas", "net_name")


def get_nccl_options(pg_name: str, nccl_comm_cfgs: dict) -> Any:
    """NCCL process-group options for ``pg_name`` from ``nccl_comm_cfgs`` (``{name: {key: value}}``), or None.

    Keys: ``is_high_priority_stream``, ``cga_cluster_size``, ``max_ctas``, ``min_ctas``, ``net_name`` ("IB" or
    "socket"); a key left out keeps NCCL's default. Unknown keys raise ``ValueError`` naming them.
    """
    if pg_name not in nccl_comm_cfgs:
        return None
    cfg = nccl_comm_cfgs[pg_name]
    unknown = sorted(set(cfg) - set(_NCCL_CONFIG_KEYS) - {"is_high_priority_stream"})
    if unknown:
        raise ValueError(f"nccl_comm_cfgs[{pg_name!r}] has unknown keys {unknown}; known: "
                         f"{['is_high_priority_stream', *_NCCL_CONFIG_KEYS]}")
    if "net_name" in cfg and str(cfg["net_name"]).lower() not in ("ib", "socket"):
        raise ValueError(f"nccl_comm_cfgs[{pg_name!r}]['net_name'] ({cfg['net_name']!r}) must be 'IB' or 'socket'")
    options_cls = getattr(dist, "ProcessGroupNCCL", None)
    if options_cls is None:
        raise RuntimeError(f"nccl_comm_cfgs[{pg_name!r}]: this torch build has no NCCL (torch.distributed."
                           "ProcessGroupNCCL), so NCCL communicator options cannot be made")
    options = options_cls.Options(is_high_priority_stream=bool(cfg.get("is_high_priority_stream", False)))
    for key in _NCCL_CONFIG_KEYS:
        if key in cfg:
            setattr(options.config, key, cfg[key])
    return options


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs: dict, pg_name: str, key_value_pair: tuple[str, Any]) -> None:
    """Set ``nccl_comm_cfgs[pg_name][key] = value`` for ``key_value_pair = (key, value)`` (in place)."""
    key, value = key_value_pair
    nccl_comm_cfgs.setdefault(pg_name, {})[key] = value
