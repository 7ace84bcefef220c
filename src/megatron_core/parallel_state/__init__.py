"""The global registry of process groups (Megatron-Core's ``parallel_state``).

``initialize_model_parallel`` splits the world into two grids that share their pipeline groups:
the dense grid (tp, cp, dp, pp) and the expert grid (etp, ep, edp, pp). Each rank then finds its
groups through the getters below. Works on gloo (CPU) and NCCL (GPU); code that wants no
globals can use :class:`ProcessGroupCollection` instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from megatron_core.config_rules import check_timeout_minutes as _check_timeout_minutes
from megatron_core.parallel_state.memory_buffer import GlobalMemoryBuffer
from megatron_core.parallel_state.rank_generator import (
    ParallelConfigError,
    RankGenerator,
)
from megatron_core.parallel_state.rank_generator import (
    generate_masked_orthogonal_rank_groups as generate_masked_orthogonal_rank_groups,
)

# name -> process group of this rank, and name -> its global ranks (or the list of lists for all groups).
_GROUPS: dict[str, dist.ProcessGroup] = {}
_GROUP_RANKS: dict[str, list[int]] = {}
_ALL_GROUP_RANKS: dict[str, list[list[int]]] = {}
_VIRTUAL_PP: dict[str, int | None] = {"rank": None, "world_size": None}
_OVERRIDES: dict[str, int] = {}
_GLOBAL_MEMORY_BUFFER: GlobalMemoryBuffer | None = None
_MEMORY_BUFFER_DESTROYED = [False]  # set by destroy_global_memory_buffer until the next initialisation


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Ranks holding the word embeddings: the first and the last pipeline stage."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Ranks holding the position embeddings: the first pipeline stage."""
    return [pp_ranks[0]]


def _check_sizes(**sizes: int | None) -> None:
    bad = {name: value for name, value in sizes.items() if value is not None and value < 1}
    if bad:
        raise ParallelConfigError(f"parallel sizes must be at least 1; got {bad}")


def _new_group(name: str, all_ranks: list[list[int]], timeout: timedelta, backend: str | None = None) -> None:
    """Create every group of ``all_ranks`` (a collective call) and keep the one holding this rank."""
    rank = dist.get_rank()
    _ALL_GROUP_RANKS[name] = all_ranks
    for ranks in all_ranks:
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            _GROUPS[name] = group
            _GROUP_RANKS[name] = list(ranks)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    get_position_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    create_gloo_process_groups: bool = True,
    rank_offset: int = 0,
    local_world_size: int | None = None,
) -> None:
    """Create the tensor, pipeline, data, context and expert parallel groups of this job.

    ``torch.distributed`` must be initialised. The world is ``local_world_size`` ranks (default:
    all of them), split as ``tp * cp * dp * pp`` for dense layers and ``etp * ep * edp * pp`` for
    experts; the left-most axis of ``order`` varies fastest. Sizes that do not fit raise
    :class:`ParallelConfigError` naming the numbers.
    """
    _check_timeout_minutes("distributed_timeout_minutes", distributed_timeout_minutes)
    _refuse_unsupported(use_sharp, nccl_communicator_config_path)
    _MEMORY_BUFFER_DESTROYED[0] = False
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before initialize_model_parallel")
    tp, pp, cp, ep = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
    )
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    _check_sizes(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
    )
    world_size = local_world_size or dist.get_world_size()
    model_size = tp * pp * cp
    if world_size % model_size != 0:
        raise ParallelConfigError(
            f"world_size ({world_size}) is not divisible by tensor_model_parallel_size ({tp}) x "
            f"pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp}) = {model_size}"
        )
    dp = world_size // model_size
    if virtual_pipeline_model_parallel_size is not None and pp <= 1:
        raise ParallelConfigError(
            f"virtual_pipeline_model_parallel_size ({virtual_pipeline_model_parallel_size}) needs "
            f"pipeline_model_parallel_size > 1 (got {pp}) for the interleaved schedule"
        )
    expert_model_size = etp * ep * pp
    if world_size % expert_model_size != 0:
        raise ParallelConfigError(
            f"world_size ({world_size}) is not divisible by expert_tensor_parallel_size ({etp}) x "
            f"expert_model_parallel_size ({ep}) x pipeline_model_parallel_size ({pp}) = {expert_model_size}"
        )
    edp = world_size // expert_model_size
    if dp % num_distributed_optimizer_instances != 0:
        raise ParallelConfigError(
            f"data parallel size ({dp}) is not divisible by num_distributed_optimizer_instances "
            f"({num_distributed_optimizer_instances})"
        )
    if model_parallel_is_initialized():
        raise RuntimeError("model parallel groups are already initialized; call destroy_model_parallel() first")

    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order, rank_offset=rank_offset)
    expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order, rank_offset=rank_offset)
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        raise ParallelConfigError(
            f"order '{order}' gives different pipeline groups for the dense grid (tp={tp}, cp={cp}, dp={dp}) "
            f"and the expert grid (etp={etp}, ep={ep}, edp={edp}); pipeline groups must be shared"
        )

    timeout = timedelta(minutes=distributed_timeout_minutes)
    gloo_needed = create_gloo_process_groups and dist.get_backend() != "gloo"
    # DP x CP first: NCCL SHARP may only use the first communicator created.
    for name, token in (("dp_cp", "dp-cp"), ("dp", "dp")):
        _new_group(name, dense.get_ranks(token), timeout)
        if gloo_needed:
            _new_group(name + "_gloo", dense.get_ranks(token), timeout, backend="gloo")
    _new_group("cp", dense.get_ranks("cp"), timeout)
    if hierarchical_context_parallel_sizes:
        _new_hierarchical_cp_groups(dense.get_ranks("cp"), list(hierarchical_context_parallel_sizes), cp, timeout)
    _new_group("mp", dense.get_ranks("tp-pp"), timeout)
    _new_group("tp", dense.get_ranks("tp"), timeout)
    pp_groups = dense.get_ranks("pp")
    _new_group("pp", pp_groups, timeout, backend=pipeline_model_parallel_comm_backend)
    embedding_fn = get_embedding_ranks or default_embedding_ranks
    position_fn = get_position_embedding_ranks or default_position_embedding_ranks
    _new_group("embd", [embedding_fn(g) for g in pp_groups], timeout)
    _new_group("pos_embd", [position_fn(g) for g in pp_groups], timeout)
    _new_group("tp_dp_cp", dense.get_ranks("tp-dp-cp"), timeout)
    _new_group("tp_dp", dense.get_ranks("tp-dp"), timeout)
    _new_group("tp_cp", dense.get_ranks("tp-cp"), timeout)

    _new_group("ep", expert.get_ranks("ep"), timeout)
    _new_group("expt_tp", expert.get_ranks("tp"), timeout)
    _new_group("tp_ep", expert.get_ranks("tp-ep"), timeout)
    _new_group("tp_ep_pp", expert.get_ranks("tp-ep-pp"), timeout)
    _new_group("expt_dp", expert.get_ranks("dp"), timeout)
    if gloo_needed:
        _new_group("expt_dp_gloo", expert.get_ranks("dp"), timeout, backend="gloo")

    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PP["rank"] = 0
        _VIRTUAL_PP["world_size"] = virtual_pipeline_model_parallel_size



def _refuse_unsupported(use_sharp: bool, nccl_communicator_config_path: str | None) -> None:
    """Options of Megatron-Core's signature that this implementation does not carry out raise when set."""
    if use_sharp:
        raise ValueError("initialize_model_parallel: use_sharp=True (NCCL SHARP for the data-parallel groups) is "
                         "not supported; leave it False")
    if nccl_communicator_config_path is not None:
        raise ValueError(f"initialize_model_parallel: nccl_communicator_config_path="
                         f"{nccl_communicator_config_path!r} (per-group NCCL communicator options) is not "
                         "supported; leave it None")


def _refuse_partial_expert_dp(partial_expert_data_parallel: bool) -> None:
    if partial_expert_data_parallel:
        raise NotImplementedError("partial expert data parallel groups need num_distributed_optimizer_instances > 1, "
                                  "which is not supported; pass partial_expert_data_parallel=False")


def _new_hierarchical_cp_groups(cp_groups: list[list[int]], sizes: list[int], cp: int, timeout: timedelta) -> None:
    """Level ``i`` groups ``sizes[i]`` CP ranks with stride ``prod(sizes[:i])`` (level 0: contiguous)."""
    product = 1
    for size in sizes:
        product *= size
    if product != cp or any(size < 1 for size in sizes):
        raise ParallelConfigError(
            f"hierarchical_context_parallel_sizes ({sizes}) must multiply to context_parallel_size ({cp})"
        )
    stride = 1
    for level, size in enumerate(sizes):
        groups = []
        for ranks in cp_groups:
            for base in range(cp):
                digit = (base // stride) % size
                if digit == 0:
                    groups.append([ranks[base + j * stride] for j in range(size)])
        _new_group(f"hcp{level}", groups, timeout)
        stride *= size
    _HIERARCHICAL_CP_LEVELS[0] = len(sizes)


_HIERARCHICAL_CP_LEVELS = [0]


def get_hierarchical_context_parallel_groups(check_initialized: bool = True) -> list | None:
    """The hierarchical context-parallel groups (innermost first), or None when not configured."""
    levels = _HIERARCHICAL_CP_LEVELS[0]
    if not levels or "hcp0" not in _GROUPS:
        if check_initialized:
            raise RuntimeError("hierarchical context-parallel groups are not initialized "
                               "(initialize_model_parallel(hierarchical_context_parallel_sizes=...))")
        return None
    return [_GROUPS[f"hcp{level}"] for level in range(levels)]


def model_parallel_is_initialized() -> bool:
    """True once :func:`initialize_model_parallel` has created the groups."""
    return "tp" in _GROUPS and "pp" in _GROUPS and "dp" in _GROUPS


def is_initialized() -> bool:
    """True when the data-parallel group exists."""
    return "dp" in _GROUPS


def is_unitialized() -> bool:
    """Megatron-Core's (misspelt) negation of :func:`is_initialized`, kept for compatibility."""
    return not is_initialized()


def destroy_model_parallel() -> None:
    """Free every group this module created and forget ranks, size overrides and the memory buffer.

    Freeing matters for long-lived processes that initialize many times (test rank pools): live
    gloo groups keep threads and sockets, and each new group gets slower to create.
    """
    global _GLOBAL_MEMORY_BUFFER
    if dist.is_initialized():
        for group in {id(g): g for g in _GROUPS.values() if g is not None}.values():
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
    _GROUPS.clear()
    _HIERARCHICAL_CP_LEVELS[0] = 0
    _GROUP_RANKS.clear()
    _ALL_GROUP_RANKS.clear()
    _OVERRIDES.clear()
    _VIRTUAL_PP.update(rank=None, world_size=None)
    _GLOBAL_MEMORY_BUFFER = None


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
    """True if this rank holds a copy of the word embeddings for this (virtual) stage."""
    if dist.get_rank() not in _GROUP_RANKS.get("embd", []):
        return False
    if ignore_virtual:
        return True
    if is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage):
        return True
    return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


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
        raise NotImplementedError("partial data parallel groups need num_distributed_optimizer_instances > 1")
    return "dp_cp" if with_context_parallel else "dp"


def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    """The data-parallel group; with ``with_context_parallel`` the DP x CP group used for gradients."""
    return _group(_dp_name(with_context_parallel, partial_data_parallel))


def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    """A gloo twin of the data-parallel group (the group itself when the backend is gloo)."""
    name = _dp_name(with_context_parallel, partial_data_parallel)
    return _GROUPS.get(name + "_gloo") or _group(name)


def get_data_parallel_world_size(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """Size of the data-parallel group."""
    name = _dp_name(with_context_parallel, partial_data_parallel)
    return _world_size(name) if name in _GROUPS else 1


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """Rank within the data-parallel group."""
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


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """A reusable scratch buffer (Megatron-Core's API; nothing in this library uses it).

    Created on the first call after ``initialize_model_parallel``, dropped by ``destroy_model_parallel``.
    """
    global _GLOBAL_MEMORY_BUFFER
    if _GLOBAL_MEMORY_BUFFER is None:
        if not model_parallel_is_initialized() or _MEMORY_BUFFER_DESTROYED[0]:
            raise RuntimeError("the global memory buffer is not initialized; call initialize_model_parallel() first")
        _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
    return _GLOBAL_MEMORY_BUFFER


def get_all_ranks() -> list[int]:
    """Every global rank of this job, in order."""
    return list(range(dist.get_world_size()))


from megatron_core.parallel_state.extras import (  # noqa: E402
    create_all_gather_groups as create_all_gather_groups,
)
from megatron_core.parallel_state.extras import create_group as create_group  # noqa: E402
from megatron_core.parallel_state.extras import (  # noqa: E402
    destroy_global_memory_buffer as destroy_global_memory_buffer,
)
from megatron_core.parallel_state.extras import update_pg_timeout as update_pg_timeout  # noqa: E402
