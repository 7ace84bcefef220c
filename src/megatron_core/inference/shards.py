"""Process groups for an inference model whose parallel layout differs from training's (Megatron-Core 0.19's
``inference.shards.build_inference_pg_collection``).

An inference copy of a model (for example the generator of an RL loop) may run at another TP/PP/EP than the
training run, on all ranks or on a window of them. :func:`build_inference_pg_collection` lays that window out on
two :class:`~megatron_core.hyper_comm_grid.HyperCommGrid` s in ``parallel_state``'s rank order, one for the dense
layers (tp, cp, dp, pp) and one for the experts (expert tp, ep, expert dp, pp), and returns their groups as a
:class:`~megatron_core.process_groups_config.ProcessGroupCollection` to pass to the model (``pg_collection``).
Creating groups is collective: every rank of the job calls it, also ranks outside the window, which get
non-member groups and should not use the result.

:func:`build_inference_pg_collections_for_shards` does this for every shard of a multi-shard layout
(:mod:`megatron_core.inference.shards_spec`): shard ``i`` takes the ranks after shard ``i - 1``'s, and each rank
gets an :class:`InferenceShard` per shard whose ``pg_collection`` is set only for the shard it belongs to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.hyper_comm_grid import HyperCommGrid
from megatron_core.inference.shards_spec import InferenceShardSpec, normalize_shard_specs
from megatron_core.process_groups_config import ProcessGroupCollection

__all__ = ["InferenceShard", "build_inference_pg_collection", "build_inference_pg_collections_for_shards"]

# Groups spanning several dims of each grid: ProcessGroupCollection field -> dims.
_DENSE_GROUPS = {"tp": ["tp"], "cp": ["cp"], "pp": ["pp"], "dp": ["dp"], "mp": ["tp", "pp"], "tp_cp": ["tp", "cp"],
                 "dp_cp": ["cp", "dp"], "tp_dp_cp": ["tp", "cp", "dp"]}
_EXPERT_GROUPS = {"ep": ["ep"], "expt_tp": ["tp"], "expt_dp": ["dp"], "tp_ep": ["tp", "ep"],
                  "tp_ep_pp": ["tp", "ep", "pp"]}


def _data_parallel_size(world_size: int, sizes: dict[str, int], layer: str) -> int:
    """``world_size`` over the product of ``sizes``; ``ValueError`` naming them when it does not divide."""
    product = math.prod(sizes.values())
    if world_size % product:
        named = " x ".join(f"{name} {size}" for name, size in sizes.items())
        raise ValueError(f"build_inference_pg_collection: world_size {world_size} is not divisible by the {layer} "
                         f"layers' {named} = {product}")
    return world_size // product


def _grid(sizes: dict[str, int], tp_pp_dp_order: bool, rank_offset: int) -> HyperCommGrid:
    """A grid over ``sizes`` (tp, a middle dim, dp, pp), ordered tp-x-dp-pp or, with ``tp_pp_dp_order``, tp-x-pp-dp."""
    names = list(sizes)
    if tp_pp_dp_order:
        names = [n for n in names if n not in ("dp", "pp")] + ["pp", "dp"]
    return HyperCommGrid([sizes[n] for n in names], names, rank_offset=rank_offset)


def _new_groups(rank_lists: list[list[int]]) -> dist.ProcessGroup | None:
    """Create a group for each rank list (every rank calls this) and return the one holding this rank."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks=ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def build_inference_pg_collection(
    world_size: int,
    tp_size: int | None = None,
    pp_size: int | None = None,
    cp_size: int | None = None,
    ep_size: int | None = None,
    expt_tp_size: int | None = None,
    use_tp_pp_dp_mapping: bool = False,
    rank_offset: int = 0,
) -> ProcessGroupCollection:
    """The process groups of an inference model on global ranks ``[rank_offset, rank_offset + world_size)``.

    Sizes left ``None`` are training's (from ``parallel_state``). Dense layers use ``world_size = tp x cp x dp x
    pp`` and the experts ``world_size = expt_tp x ep x expt_dp x pp``, both in ``parallel_state``'s order (tp fastest,
    then cp or ep, then dp, then pp; ``use_tp_pp_dp_mapping`` puts pp before dp). Every rank of the job must call
    it; ranks outside the window receive non-member groups. ``ValueError`` when a size does not divide.
    """
    tp_size = parallel_state.get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    pp_size = parallel_state.get_pipeline_model_parallel_world_size() if pp_size is None else pp_size
    cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
    ep_size = parallel_state.get_expert_model_parallel_world_size() if ep_size is None else ep_size
    expt_tp_size = parallel_state.get_expert_tensor_parallel_world_size() if expt_tp_size is None else expt_tp_size
    if world_size <= 0:
        raise ValueError(f"build_inference_pg_collection: world_size must be positive, got {world_size}")
    dense_dp = _data_parallel_size(world_size, {"tp": tp_size, "cp": cp_size, "pp": pp_size}, "dense")
    expert_dp = _data_parallel_size(world_size, {"expt_tp": expt_tp_size, "ep": ep_size, "pp": pp_size}, "expert")
    dense = {"tp": tp_size, "cp": cp_size, "dp": dense_dp, "pp": pp_size}
    expert = {"tp": expt_tp_size, "ep": ep_size, "dp": expert_dp, "pp": pp_size}

    dense_grid = _grid(dense, use_tp_pp_dp_mapping, rank_offset)
    expert_grid = _grid(expert, use_tp_pp_dp_mapping, rank_offset)
    groups = {name: dense_grid.create_pg(dims) for name, dims in _DENSE_GROUPS.items()}
    groups.update({name: expert_grid.create_pg(dims) for name, dims in _EXPERT_GROUPS.items()})
    pipelines = dense_grid.get_rank_enum("pp")
    groups["embd"] = _new_groups([parallel_state.default_embedding_ranks(p) for p in pipelines])
    groups["pos_embd"] = _new_groups([parallel_state.default_position_embedding_ranks(p) for p in pipelines])
    return ProcessGroupCollection(**groups)


@dataclass
class InferenceShard:
    """One shard of a multi-shard inference layout as seen from this rank.

    ``spec`` is its :class:`~megatron_core.inference.shards_spec.InferenceShardSpec`, ``rank_offset`` its first
    global rank and ``world_size`` its rank count (``tp * pp * dp``). ``pg_collection`` holds the shard's groups
    on the shard's own ranks and is ``None`` elsewhere: the shard whose ``pg_collection is not None`` is this
    rank's.
    """

    spec: InferenceShardSpec
    rank_offset: int
    world_size: int
    pg_collection: ProcessGroupCollection | None


def build_inference_pg_collections_for_shards(
    total_world_size: int,
    shards: str | Sequence[InferenceShardSpec | Mapping],
    use_tp_pp_dp_mapping: bool = False,
) -> list[InferenceShard]:
    """One :class:`InferenceShard` per shard of ``shards`` (a layout string, specs or dicts, see
    :func:`~megatron_core.inference.shards_spec.normalize_shard_specs`), over consecutive rank windows.

    Shard ``i`` owns global ranks ``[offset_i, offset_i + tp_i * pp_i * dp_i)`` with ``offset_0 = 0``; the shards
    must use all ``total_world_size`` ranks (``ValueError`` otherwise). Group creation is collective: every rank
    of the job calls this, and gets ``pg_collection`` only for its own shard.
    """
    specs = normalize_shard_specs(shards, total_world_size)
    rank = dist.get_rank()
    result = []
    offset = 0
    for spec in specs:
        collection = build_inference_pg_collection(
            spec.world_size, tp_size=spec.tp, pp_size=spec.pp, cp_size=spec.cp, ep_size=spec.ep,
            expt_tp_size=spec.expt_tp, use_tp_pp_dp_mapping=use_tp_pp_dp_mapping, rank_offset=offset)
        mine = offset <= rank < offset + spec.world_size
        result.append(InferenceShard(spec, offset, spec.world_size, collection if mine else None))
        offset += spec.world_size
    return result
