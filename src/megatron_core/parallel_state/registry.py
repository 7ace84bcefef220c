"""The registry behind ``parallel_state``: this rank's process groups by name, their ranks, and
the size/rank overrides. ``initialize`` fills it; the getter modules read it."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from megatron_core.parallel_state.memory_buffer import GlobalMemoryBuffer

# name -> process group of this rank, and name -> its global ranks (or the list of lists for all groups).
_GROUPS: dict[str, dist.ProcessGroup] = {}
_GROUP_RANKS: dict[str, list[int]] = {}
_ALL_GROUP_RANKS: dict[str, list[list[int]]] = {}
_VIRTUAL_PP: dict[str, int | None] = {"rank": None, "world_size": None}
_OVERRIDES: dict[str, int] = {}
_HIERARCHICAL_CP_LEVELS = [0]
# Sizes of the hybrid DP x CP groups (hybrid_context_parallel), registered as 'hybrid_dp_cp_<size>'.
_HYBRID_DP_CP_SIZES: list[int] = []
# The scratch buffer of get_global_memory_buffer, made on first use; "destroyed" by destroy_global_memory_buffer.
_MEMORY_BUFFER: dict = {"buffer": None, "destroyed": False}


def _new_group(name: str, all_ranks: list[list[int]], timeout: timedelta, backend: str | None = None) -> None:
    """Create every group of ``all_ranks`` (a collective call) and keep the one holding this rank."""
    rank = dist.get_rank()
    _ALL_GROUP_RANKS[name] = all_ranks
    for ranks in all_ranks:
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            _GROUPS[name] = group
            _GROUP_RANKS[name] = list(ranks)


def model_parallel_is_initialized() -> bool:
    """True once :func:`initialize_model_parallel` has created the groups."""
    return "tp" in _GROUPS and "pp" in _GROUPS and "dp" in _GROUPS


def is_initialized() -> bool:
    """True when the data-parallel group exists."""
    return "dp" in _GROUPS


def is_unitialized() -> bool:
    """Megatron-Core's (misspelt) negation of :func:`is_initialized`, kept for compatibility."""
    return not is_initialized()


def _group(name: str, check_initialized: bool = True) -> dist.ProcessGroup | None:
    group = _GROUPS.get(name)
    if group is None and check_initialized:
        raise RuntimeError(f"the '{name}' process group is not initialized; call initialize_model_parallel() first")
    return group


def _world_size(name: str) -> int:
    return dist.get_world_size(_group(name))


def _rank(name: str) -> int:
    return dist.get_rank(_group(name))


def get_group_ranks(name: str) -> list[int]:
    """Global ranks of this rank's group ``name`` (``"tp"``, ``"pp"``, ``"dp_cp"``, ``"expt_dp"``, ...)."""
    _group(name)
    return list(_GROUP_RANKS[name])


def get_all_group_ranks(name: str) -> list[list[int]]:
    """Every group of kind ``name`` across the world, as lists of global ranks."""
    _group(name)
    return [list(g) for g in _ALL_GROUP_RANKS[name]]


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """A reusable scratch buffer (Megatron-Core's API; nothing in this library uses it).

    Created on the first call after ``initialize_model_parallel``, dropped by ``destroy_model_parallel``.
    """
    if _MEMORY_BUFFER["buffer"] is None:
        if not model_parallel_is_initialized() or _MEMORY_BUFFER["destroyed"]:
            raise RuntimeError("the global memory buffer is not initialized; call initialize_model_parallel() first")
        _MEMORY_BUFFER["buffer"] = GlobalMemoryBuffer()
    return _MEMORY_BUFFER["buffer"]
