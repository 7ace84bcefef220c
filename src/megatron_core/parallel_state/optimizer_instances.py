"""Groups of the partial distributed optimizer (Megatron-Core's ``num_distributed_optimizer_instances``).

With ``n`` instances the data-parallel ranks of every model replica split into ``n`` contiguous blocks. The
distributed optimizer shards its state over the ranks of one block (the *intra* partial data-parallel groups:
``intra_dp_cp`` for dense weights, ``intra_expt_dp`` for experts); every block keeps a whole replica of it. After
the gradients are reduce-scattered inside a block, each rank all-reduces its shard with the ranks holding the
same shard in the other blocks (the *inter* group, ``inter_dist_opt``, one rank per instance), so the blocks
step identically. ``intra_dist_opt`` holds every rank of one instance (all of its model-parallel ranks too): the
gradient statistics of one replica.

With one instance the intra groups are the full data-parallel groups and there is no inter group, as in
Megatron-Core. :func:`create_hierarchical_groups` is Megatron-Core's general helper for such nested groups.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron_core.parallel_state.extras import create_group
from megatron_core.parallel_state.rank_generator import ParallelConfigError, RankGenerator
from megatron_core.parallel_state.registry import _ALL_GROUP_RANKS, _GROUP_RANKS, _GROUPS, _group, _new_group

__all__ = [
    "create_hierarchical_groups",
    "get_inter_distributed_optimizer_instance_group",
    "get_intra_distributed_optimizer_instance_group",
    "hierarchical_group_ranks",
]


def hierarchical_group_ranks(ranks: list[int], hierarchical_group_sizes: list[int]) -> list[list[list[int]]]:
    """Every group of every level, for ``ranks`` split by ``hierarchical_group_sizes`` (innermost first).

    Level ``i`` groups ``sizes[i]`` ranks spaced ``prod(sizes[:i])`` apart inside blocks of ``prod(sizes[:i+1])``:
    16 ranks with sizes ``[2, 2, 4]`` give level 0 ``[0, 1], [2, 3], ...``, level 1 ``[0, 2], [1, 3], ...`` and
    level 2 ``[0, 4, 8, 12], ...``. The sizes must multiply to ``len(ranks)``.
    """
    total = 1
    for size in hierarchical_group_sizes:
        if size < 1:
            raise ValueError(f"hierarchical_group_sizes ({hierarchical_group_sizes}) must be positive")
        total *= size
    if total != len(ranks):
        raise ValueError(f"hierarchical_group_sizes ({hierarchical_group_sizes}) multiply to {total}, but there are "
                         f"{len(ranks)} ranks")
    levels, inner = [], 1
    for size in hierarchical_group_sizes:
        block = inner * size
        levels.append([[ranks[start + offset + j * inner] for j in range(size)]
                       for start in range(0, len(ranks), block) for offset in range(inner)])
        inner = block
    return levels


def create_hierarchical_groups(rank: int, ranks: list[int], hierarchical_group_sizes: list[int],
                               create_gloo_process_groups: bool = False, pg_options: Any = None,
                               timeout: timedelta | None = None, group_desc: str | None = None,
                               ) -> tuple[list[Any], list[Any]]:
    """Create the nested groups of :func:`hierarchical_group_ranks` (a collective call over the world).

    Returns ``rank``'s group at each level and its gloo twin (``None`` unless ``create_gloo_process_groups``).
    ``pg_options`` is one value for every level or a list with one per level.
    """
    levels = hierarchical_group_ranks(ranks, hierarchical_group_sizes)
    options = pg_options if isinstance(pg_options, list) else [pg_options] * len(levels)
    if len(options) != len(levels):
        raise ValueError(f"pg_options has {len(options)} entries for {len(levels)} levels")
    mine, mine_gloo = [], []
    for level, groups in enumerate(levels):
        for members in groups:
            group = create_group(members, timeout=timeout, pg_options=options[level],
                                 group_desc=f"HIERARCHICAL_{group_desc}_L{level}")
            gloo = (create_group(members, timeout=timeout, backend="gloo",
                                 group_desc=f"HIERARCHICAL_{group_desc}_GLOO_L{level}")
                    if create_gloo_process_groups else None)
            if rank in members:
                mine.append(group)
                mine_gloo.append(gloo)
    return mine, mine_gloo


def _alias(name: str, existing: str) -> None:
    """Register the already created group ``existing`` under ``name`` too."""
    if existing in _GROUPS:
        _GROUPS[name] = _GROUPS[existing]
        _GROUP_RANKS[name] = _GROUP_RANKS[existing]
        _ALL_GROUP_RANKS[name] = _ALL_GROUP_RANKS[existing]


def _check_inter_groups_align_dense_shards(dense_intra: list[list[int]], inter: list[list[int]], order: str) -> None:
    """Each inter group must join ranks that hold the same shard (position) of their dense intra groups."""
    position = {r: (i, p) for i, members in enumerate(dense_intra) for p, r in enumerate(members)}
    for members in inter:
        blocks = {position[r][0] for r in members}
        shards = {position[r][1] for r in members}
        if len(shards) != 1 or len(blocks) != len(members):
            raise ParallelConfigError(
                f"num_distributed_optimizer_instances: with order '{order}' the expert grid's instance groups "
                f"{members} do not hold one shard position of distinct dense data-parallel blocks; use an order "
                "with 'dp' outside 'tp', 'cp' and 'ep' (the default 'tp-cp-ep-dp-pp')")


def new_distributed_optimizer_instance_groups(dense: RankGenerator, expert: RankGenerator, instances: int,
                                              timeout: timedelta, gloo_needed: bool, order: str) -> None:
    """Create (or alias, with one instance) the intra, inter and instance groups; called by initialization."""
    expert_dp = expert.get_ranks("dp")
    edp = len(expert_dp[0])
    if edp % instances:
        raise ParallelConfigError(f"expert data parallel size ({edp}) is not divisible by "
                                  f"num_distributed_optimizer_instances ({instances})")
    # One expert model-parallel (tp-ep-pp) group per expert data-parallel index, in that index's order: an
    # instance is a run of edp / instances of them.
    model_groups, step = expert.get_ranks("tp-ep-pp"), edp // instances
    instance_blocks = [sorted(r for g in model_groups[i:i + step] for r in g) for i in range(0, len(model_groups), step)]
    if instances == 1:
        for suffix in ("", "_gloo"):
            _alias("intra_dp_cp" + suffix, "dp_cp" + suffix)
            _alias("intra_expt_dp" + suffix, "expt_dp" + suffix)
        whole = instance_blocks[0]
        if len(whole) == dist.get_world_size():
            _GROUPS["intra_dist_opt"], _GROUP_RANKS["intra_dist_opt"] = dist.group.WORLD, whole
            _ALL_GROUP_RANKS["intra_dist_opt"] = [whole]
        else:
            _new_group("intra_dist_opt", [whole], timeout)
        return
    dense_intra = []
    for members in dense.get_ranks("dp-cp"):
        size = len(members) // instances
        dense_intra.extend(members[i * size:(i + 1) * size] for i in range(instances))
    expert_levels = [hierarchical_group_ranks(members, [edp // instances, instances]) for members in expert_dp]
    expert_intra = [g for levels in expert_levels for g in levels[0]]
    inter = [g for levels in expert_levels for g in levels[1]]
    _check_inter_groups_align_dense_shards(dense_intra, inter, order)
    _new_group("intra_dp_cp", dense_intra, timeout)
    _new_group("intra_expt_dp", expert_intra, timeout)
    if gloo_needed:
        _new_group("intra_dp_cp_gloo", dense_intra, timeout, backend="gloo")
        _new_group("intra_expt_dp_gloo", expert_intra, timeout, backend="gloo")
    _new_group("inter_dist_opt", inter, timeout)
    _new_group("intra_dist_opt", instance_blocks, timeout)


def get_intra_distributed_optimizer_instance_group(check_initialized: bool = True):
    """Every rank of this rank's distributed optimizer instance (its data- and model-parallel ranks)."""
    return _group("intra_dist_opt", check_initialized)


def get_inter_distributed_optimizer_instance_group(check_initialized: bool = True):
    """The ranks holding this rank's optimizer shard in the other instances (only with more than one instance)."""
    if check_initialized and "inter_dist_opt" not in _GROUPS:
        raise RuntimeError("the inter distributed optimizer instance group is not initialized: it exists only with "
                           "initialize_model_parallel(num_distributed_optimizer_instances > 1)")
    return _GROUPS.get("inter_dist_opt")
