"""Getters of the expert grid's groups: expert model, expert tensor and expert data parallel."""

from __future__ import annotations

from megatron_core.parallel_state.registry import (
    _GROUPS,
    _OVERRIDES,
    _group,
    _rank,
    _world_size,
    get_group_ranks,
)


def _expert_dp_name(partial_expert_data_parallel: bool) -> str:
    """The expert data-parallel group, or its ranks in this rank's distributed optimizer instance."""
    return "intra_expt_dp" if partial_expert_data_parallel else "expt_dp"


def _set_override(key: str, value: int | None) -> None:
    if value is None:
        _OVERRIDES.pop(key, None)
    else:
        _OVERRIDES[key] = value


# --- experts ---------------------------------------------------------------------------------
def get_expert_model_parallel_group(check_initialized: bool = True):
    """The expert-parallel group."""
    return _group("ep", check_initialized)


def get_expert_model_parallel_world_size() -> int:
    """Size of the expert-parallel group (the value of :func:`set_expert_model_parallel_world_size` if set)."""
    if "ep_world_size" in _OVERRIDES:
        return _OVERRIDES["ep_world_size"]
    return _world_size("ep") if "ep" in _GROUPS else 1


def set_expert_model_parallel_world_size(world_size: int | None) -> None:
    """Override the expert-parallel size (for code without groups); ``None`` drops the override."""
    _set_override("ep_world_size", world_size)


def get_expert_model_parallel_rank() -> int:
    """Rank within the expert-parallel group (the value of :func:`set_expert_model_parallel_rank` if set)."""
    if "ep_rank" in _OVERRIDES:
        return _OVERRIDES["ep_rank"]
    return _rank("ep") if "ep" in _GROUPS else 0


def set_expert_model_parallel_rank(rank: int | None) -> None:
    """Override the expert-parallel rank (for code without groups); ``None`` drops the override."""
    _set_override("ep_rank", rank)


def get_expert_model_parallel_src_rank() -> int:
    """Global rank of expert-parallel rank 0 in this rank's group."""
    return get_group_ranks("ep")[0]


def get_expert_tensor_parallel_group(check_initialized: bool = True):
    """The expert tensor-parallel group."""
    return _group("expt_tp", check_initialized)


def get_expert_tensor_parallel_world_size() -> int:
    """Size of the expert tensor-parallel group.

    The value of :func:`set_expert_tensor_parallel_world_size` if set; without the group, the tensor-parallel
    size override (as in Megatron-Core), else 1.
    """
    if "etp_world_size" in _OVERRIDES:
        return _OVERRIDES["etp_world_size"]
    if "expt_tp" in _GROUPS:
        return _world_size("expt_tp")
    return _OVERRIDES.get("tp_world_size", 1)


def set_expert_tensor_parallel_world_size(world_size: int | None) -> None:
    """Override the expert tensor-parallel size (for code without groups); ``None`` drops the override."""
    _set_override("etp_world_size", world_size)


def get_expert_tensor_parallel_rank() -> int:
    """Rank within the expert tensor-parallel group.

    The value of :func:`set_expert_tensor_parallel_rank` if set; without the group, the tensor-parallel rank
    override (as in Megatron-Core), else 0.
    """
    if "etp_rank" in _OVERRIDES:
        return _OVERRIDES["etp_rank"]
    if "expt_tp" in _GROUPS:
        return _rank("expt_tp")
    return _OVERRIDES.get("tp_rank", 0)


def set_expert_tensor_parallel_rank(rank: int | None) -> None:
    """Override the expert tensor-parallel rank (for code without groups); ``None`` drops the override."""
    _set_override("etp_rank", rank)


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True):
    """The expert tensor x expert model parallel group."""
    return _group("tp_ep", check_initialized)


def get_expert_tensor_and_model_parallel_world_size() -> int:
    """Size of the expert tensor x expert model parallel group."""
    return _world_size("tp_ep") if "tp_ep" in _GROUPS else 1


def get_expert_tensor_and_model_parallel_rank() -> int:
    """Rank within the expert tensor x expert model parallel group."""
    return _rank("tp_ep") if "tp_ep" in _GROUPS else 0


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True):
    """The expert tensor x expert model x pipeline parallel group."""
    return _group("tp_ep_pp", check_initialized)


def get_expert_data_parallel_group(check_initialized: bool = True, partial_expert_data_parallel: bool = False):
    """The expert data-parallel group (gradient reduction of expert weights); with
    ``partial_expert_data_parallel`` its ranks in this rank's distributed optimizer instance."""
    return _group(_expert_dp_name(partial_expert_data_parallel), check_initialized)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False):
    """A gloo twin of the (partial) expert data-parallel group."""
    name = _expert_dp_name(partial_expert_data_parallel)
    return _GROUPS.get(name + "_gloo") or _group(name)


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    """Size of the (partial) expert data-parallel group."""
    name = _expert_dp_name(partial_expert_data_parallel)
    return _world_size(name) if name in _GROUPS else 1


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    """Rank within the (partial) expert data-parallel group."""
    name = _expert_dp_name(partial_expert_data_parallel)
    return _rank(name) if name in _GROUPS else 0
