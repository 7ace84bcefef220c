"""Getters and setters of the dense grid's groups: tensor, pipeline (and virtual pipeline),
embedding, model, data and context parallel. Before initialisation sizes are 1 and ranks 0."""

from __future__ import annotations

import warnings

import torch.distributed as dist

from megatron_core.parallel_state.registry import (
    _GROUP_RANKS,
    _GROUPS,
    _OVERRIDES,
    _VIRTUAL_PP,
    _group,
    _rank,
    _world_size,
    get_group_ranks,
)


# --- tensor parallel -------------------------------------------------------------------------
def get_tensor_model_parallel_group(check_initialized: bool = True):
    """The tensor-parallel group of this rank."""
    return _group("tp", check_initialized)


def get_tensor_model_parallel_world_size() -> int:
    """Size of the tensor-parallel group."""
    if "tp_world_size" in _OVERRIDES:
        return _OVERRIDES["tp_world_size"]
    return _world_size("tp") if "tp" in _GROUPS else 1


def get_tensor_model_parallel_rank() -> int:
    """Rank within the tensor-parallel group."""
    if "tp_rank" in _OVERRIDES:
        return _OVERRIDES["tp_rank"]
    return _rank("tp") if "tp" in _GROUPS else 0


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    """Override the tensor-parallel size (for tests without groups)."""
    _set_override("tp_world_size", world_size)


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Override the tensor-parallel rank (for tests without groups)."""
    _set_override("tp_rank", rank)


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's group."""
    return get_group_ranks("tp")[0]


def _set_override(key: str, value: int | None) -> None:
    if value is None:
        _OVERRIDES.pop(key, None)
    else:
        _OVERRIDES[key] = value


# --- pipeline parallel -----------------------------------------------------------------------
def get_pipeline_model_parallel_group(check_initialized: bool = True):
    """The pipeline-parallel group of this rank."""
    return _group("pp", check_initialized)


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    if "pp_world_size" in _OVERRIDES:
        return _OVERRIDES["pp_world_size"]
    return _world_size("pp") if "pp" in _GROUPS else 1


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage."""
    if "pp_rank" in _OVERRIDES:
        return _OVERRIDES["pp_rank"]
    return _rank("pp") if "pp" in _GROUPS else 0


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Override the pipeline size (for tests without groups)."""
    _set_override("pp_world_size", world_size)


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Override the pipeline rank (for tests without groups)."""
    _set_override("pp_rank", rank)


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of this rank's pipeline."""
    return get_group_ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of this rank's pipeline."""
    return get_group_ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (wrapping around)."""
    ranks = get_group_ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (wrapping around)."""
    ranks = get_group_ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def _resolve_vp_stage(vp_stage: int | None) -> int | None:
    return _VIRTUAL_PP["rank"] if vp_stage is None else vp_stage


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True on the first pipeline stage (and, unless ``ignore_virtual``, on virtual stage 0)."""
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None:
        if _resolve_vp_stage(vp_stage) != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True on the last pipeline stage (and, unless ``ignore_virtual``, on the last virtual stage)."""
    vpp = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vpp is not None:
        if _resolve_vp_stage(vp_stage) != vpp - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Virtual stages per pipeline rank, or ``None`` without interleaving."""
    return _VIRTUAL_PP["world_size"]


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The current virtual stage (prefer passing ``vp_stage`` explicitly)."""
    return _VIRTUAL_PP["rank"]


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Deprecated: pass ``vp_stage`` to modules and stage predicates instead."""
    warnings.warn(
        "set_virtual_pipeline_model_parallel_rank is deprecated; pass vp_stage explicitly",
        DeprecationWarning,
        stacklevel=2,
    )
    _VIRTUAL_PP["rank"] = rank


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Set the number of virtual stages per pipeline rank."""
    _VIRTUAL_PP["world_size"] = world_size


# --- embeddings ------------------------------------------------------------------------------
def get_embedding_group(check_initialized: bool = True):
    """Group of the ranks that hold (tied) word embeddings: first and last stage by default."""
    return _group("embd", check_initialized)


def get_position_embedding_group(check_initialized: bool = True):
    """Group of the ranks that hold position embeddings: the first stage by default."""
    return _group("pos_embd", check_initialized)


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True if this rank holds a copy of the word embeddings for this (virtual) stage.

    With ``ignore_virtual=False`` the group's first rank counts on its first virtual stage only, its last rank on
    its last virtual stage only, any other member (a standalone MTP stage) on every stage, as in Megatron-Core.
    """
    ranks = _GROUP_RANKS.get("embd", [])
    rank = dist.get_rank()
    if rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    """True if this rank holds the position embeddings."""
    return dist.get_rank() in _GROUP_RANKS.get("pos_embd", [])


# --- model parallel, data parallel, context parallel ----------------------------------------
def get_model_parallel_group(check_initialized: bool = True):
    """The tensor x pipeline parallel group."""
    return _group("mp", check_initialized)


def get_model_parallel_src_rank() -> int:
    """Global rank of the first rank of this rank's model-parallel group."""
    return get_group_ranks("mp")[0]


def _dp_name(with_context_parallel: bool, partial_data_parallel: bool = False) -> str:
    if partial_data_parallel:
        if not with_context_parallel:
            raise ValueError("partial_data_parallel=True needs with_context_parallel=True: the partial distributed "
                             "optimizer's groups include the context-parallel ranks")
        return "intra_dp_cp"
    return "dp_cp" if with_context_parallel else "dp"


def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    """The data-parallel group; with ``with_context_parallel`` the DP x CP group used for gradients; with
    ``partial_data_parallel`` too, the DP x CP ranks of this rank's distributed optimizer instance."""
    return _group(_dp_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    """A gloo twin of the data-parallel group (the group itself when the backend is gloo)."""
    name = _dp_name(with_context_parallel, partial_data_parallel)
    return _GROUPS.get(name + "_gloo") or _group(name)


def get_data_parallel_world_size(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """Size of the data-parallel group."""
    name = _dp_name(with_context_parallel, partial_data_parallel)
    return _world_size(name) if name in _GROUPS else 1


def set_data_parallel_rank(rank: int | None) -> None:
    """Override the data-parallel rank that :func:`get_data_parallel_rank` returns (None: the group's again)."""
    _set_override("dp_rank", rank)


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """Rank within the data-parallel group (the value of :func:`set_data_parallel_rank` if set)."""
    if "dp_rank" in _OVERRIDES:
        return _OVERRIDES["dp_rank"]
    name = _dp_name(with_context_parallel, partial_data_parallel)
    return _rank(name) if name in _GROUPS else 0


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of data-parallel rank 0 in this rank's group."""
    return get_group_ranks(_dp_name(with_context_parallel))[0]


def get_context_parallel_group(check_initialized: bool = True):
    """The context-parallel group."""
    return _group("cp", check_initialized)


def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int]:
    """Global ranks of this rank's context-parallel group."""
    return get_group_ranks("cp")


def get_context_parallel_world_size() -> int:
    """Size of the context-parallel group."""
    return _world_size("cp") if "cp" in _GROUPS else 1


def get_context_parallel_rank() -> int:
    """Rank within the context-parallel group."""
    return _rank("cp") if "cp" in _GROUPS else 0


def get_tensor_and_context_parallel_group(check_initialized: bool = True):
    """The tensor x context parallel group."""
    return _group("tp_cp", check_initialized)


def get_tensor_and_context_parallel_world_size() -> int:
    """Size of the tensor x context parallel group."""
    return _world_size("tp_cp") if "tp_cp" in _GROUPS else 1


def get_tensor_and_context_parallel_rank() -> int:
    """Rank within the tensor x context parallel group."""
    return _rank("tp_cp") if "tp_cp" in _GROUPS else 0


def get_tensor_and_data_parallel_group(check_initialized: bool = True, with_context_parallel: bool = False):
    """The tensor x data (x context) parallel group."""
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized)


def get_tensor_and_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Size of the tensor x data (x context) parallel group."""
    return _world_size("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_amax_reduction_group(with_context_parallel: bool = False, tp_only_amax_red: bool = False):
    """Group over which FP8 amax values are reduced."""
    if tp_only_amax_red:
        return get_tensor_and_context_parallel_group() if with_context_parallel else get_tensor_model_parallel_group()
    return get_tensor_and_data_parallel_group(with_context_parallel=with_context_parallel)
