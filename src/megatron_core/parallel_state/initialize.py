"""Creating and destroying the job's process groups (Megatron-Core's ``initialize_model_parallel``).

The world is split into two grids that share their pipeline groups: the dense grid (tp, cp, dp,
pp) and the expert grid (etp, ep, edp, pp); every group is registered in :mod:`.registry`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from megatron_core.config_rules import check_timeout_minutes as _check_timeout_minutes
from megatron_core.parallel_state.hybrid_cp import _new_hybrid_dp_cp_groups, hybrid_dp_cp_group_sizes
from megatron_core.parallel_state.optimizer_instances import new_distributed_optimizer_instance_groups
from megatron_core.parallel_state.rank_generator import ParallelConfigError, RankGenerator
from megatron_core.parallel_state.registry import (
    _ALL_GROUP_RANKS,
    _GROUP_RANKS,
    _GROUPS,
    _HIERARCHICAL_CP_LEVELS,
    _HYBRID_DP_CP_SIZES,
    _MEMORY_BUFFER,
    _OVERRIDES,
    _VIRTUAL_PP,
    _new_group,
    model_parallel_is_initialized,
)

# The group timeout of the last initialize_model_parallel, for groups made again later (set_embedding_ranks).
_TIMEOUT: dict[str, timedelta] = {}


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Ranks holding the word embeddings: the first and the last pipeline stage."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Ranks holding the position embeddings: the first pipeline stage."""
    return [pp_ranks[0]]


def set_embedding_ranks(get_embedding_ranks: Callable[[list[int]], list[int]]) -> bool:
    """Make each pipeline group's embedding group ``get_embedding_ranks(pp_ranks)`` after initialisation.

    The same rule as ``initialize_model_parallel(get_embedding_ranks=...)``, for callers that learn the ranks only
    from the model config (standalone MTP stages hold a copy of the word embedding). Nothing happens, and nothing is
    communicated, when every group already has those ranks; otherwise the groups are created anew (a collective
    call: every rank must make it with the same rule) and this rank's old one is destroyed. Returns whether the
    groups changed.
    """
    if "embd" not in _ALL_GROUP_RANKS:
        raise RuntimeError("set_embedding_ranks needs initialize_model_parallel() first")
    wanted = [list(get_embedding_ranks(list(ranks))) for ranks in _ALL_GROUP_RANKS["pp"]]
    if wanted == _ALL_GROUP_RANKS["embd"]:
        return False
    old = _GROUPS.pop("embd", None)
    _GROUP_RANKS.pop("embd", None)
    _new_group("embd", wanted, _TIMEOUT.get("groups", timedelta(minutes=30)))
    if old is not None and old is not dist.GroupMember.WORLD:
        dist.destroy_process_group(old)
    return True


def _check_sizes(**sizes: int | None) -> None:
    bad = {name: value for name, value in sizes.items() if value is not None and value < 1}
    if bad:
        raise ParallelConfigError(f"parallel sizes must be at least 1; got {bad}")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel: bool = False,
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
    :class:`ParallelConfigError` naming the numbers. ``hybrid_context_parallel`` also builds the
    power-of-two slices of each DP x CP group (:mod:`.hybrid_cp`).
    """
    _check_timeout_minutes("distributed_timeout_minutes", distributed_timeout_minutes)
    _refuse_unsupported(use_sharp, nccl_communicator_config_path)
    _MEMORY_BUFFER["destroyed"] = False
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
    if hybrid_context_parallel:
        hybrid_dp_cp_group_sizes(dp * cp)  # raises unless DP x CP is even
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
    _TIMEOUT["groups"] = timeout
    gloo_needed = create_gloo_process_groups and dist.get_backend() != "gloo"
    # DP x CP first: NCCL SHARP may only use the first communicator created.
    for name, token in (("dp_cp", "dp-cp"), ("dp", "dp")):
        _new_group(name, dense.get_ranks(token), timeout)
        if gloo_needed:
            _new_group(name + "_gloo", dense.get_ranks(token), timeout, backend="gloo")
    if hybrid_context_parallel:
        _new_hybrid_dp_cp_groups(dense.get_ranks("dp-cp"), timeout)
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
    new_distributed_optimizer_instance_groups(dense, expert, num_distributed_optimizer_instances, timeout,
                                              gloo_needed, order)

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


def get_hierarchical_context_parallel_groups(check_initialized: bool = True) -> list | None:
    """The hierarchical context-parallel groups (innermost first), or None when not configured."""
    levels = _HIERARCHICAL_CP_LEVELS[0]
    if not levels or "hcp0" not in _GROUPS:
        if check_initialized:
            raise RuntimeError("hierarchical context-parallel groups are not initialized "
                               "(initialize_model_parallel(hierarchical_context_parallel_sizes=...))")
        return None
    return [_GROUPS[f"hcp{level}"] for level in range(levels)]


def destroy_model_parallel() -> None:
    """Free every group this module created and forget ranks, size overrides and the memory buffer.

    Freeing matters for long-lived processes that initialize many times (test rank pools): live
    gloo groups keep threads and sockets, and each new group gets slower to create.
    """
    if dist.is_initialized():
        for group in {id(g): g for g in _GROUPS.values() if g is not None}.values():
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
    _GROUPS.clear()
    _HIERARCHICAL_CP_LEVELS[0] = 0
    _HYBRID_DP_CP_SIZES.clear()
    _GROUP_RANKS.clear()
    _ALL_GROUP_RANKS.clear()
    _OVERRIDES.clear()
    _VIRTUAL_PP.update(rank=None, world_size=None)
    _MEMORY_BUFFER["buffer"] = None
