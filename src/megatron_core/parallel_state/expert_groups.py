"""Getters of the expert grid's groups: expert model, expert tensor and expert data parallel."""

from __future__ import annotations

from megatron_core.parallel_state.registry import _GROUPS, _group, _rank, _world_size, get_group_ranks


def _refuse_partial_expert_dp(partial_expert_data_parallel: bool) -> None:
    if partial_expert_data_parallel:
        raise NotImplementedError("partial expert data parallel groups need num_distributed_optimizer_instances > 1, "
                                  "which is not supported; pass partial_expert_data_parallel=False")


# --- experts ---------------------------------------------------------------------------------
def get_expert_model_parallel_group(check_initialized: bool = True):
    """The expert-parallel group."""
    return _group("ep", check_initialized)


def get_expert_model_parallel_world_size() -> int:
    """Size of the expert-parallel group."""
    return _world_size("ep") if "ep" in _GROUPS else 1


def get_expert_model_parallel_rank() -> int:
    """Rank within the expert-parallel group."""
    return _rank("ep") if "ep" in _GROUPS else 0


def get_expert_model_parallel_src_rank() -> int:
    """Global rank of expert-parallel rank 0 in this rank's group."""
    return get_group_ranks("ep")[0]


def get_expert_tensor_parallel_group(check_initialized: bool = True):
    """The expert tensor-parallel group."""
    return _group("expt_tp", check_initialized)


def get_expert_tensor_parallel_world_size() -> int:
    """Size of the expert tensor-parallel group."""
    return _world_size("expt_tp") if "expt_tp" in _GROUPS else 1


def get_expert_tensor_parallel_rank() -> int:
    """Rank within the expert tensor-parallel group."""
    return _rank("expt_tp") if "expt_tp" in _GROUPS else 0


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
    """The expert data-parallel group (gradient reduction of expert weights)."""
    _refuse_partial_expert_dp(partial_expert_data_parallel)
    return _group("expt_dp", check_initialized)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False):
    """A gloo twin of the expert data-parallel group."""
    _refuse_partial_expert_dp(partial_expert_data_parallel)
    return _GROUPS.get("expt_dp_gloo") or _group("expt_dp")


def get_expert_data_parallel_world_size(partial_expert_data_parallel: bool = False) -> int:
    """Size of the expert data-parallel group."""
    _refuse_partial_expert_dp(partial_expert_data_parallel)
    return _world_size("expt_dp") if "expt_dp" in _GROUPS else 1


def get_expert_data_parallel_rank(partial_expert_data_parallel: bool = False) -> int:
    """Rank within the expert data-parallel group."""
    _refuse_partial_expert_dp(partial_expert_data_parallel)
    return _rank("expt_dp") if "expt_dp" in _GROUPS else 0
