"""``LayerWiseDistributedOptimizer``: data-parallel ranks split the optimizer work by whole parameters.

Megatron-Core 0.19's layer-wise sharding: DDP all-reduces the gradients as usual (every rank keeps the
whole model and every gradient), each data-parallel rank owns a set of whole parameters and runs the
inner optimizer (Muon, Adam, Lion or SGD) on those alone, and the updated parameters are then all-gathered so
every rank holds the full model again. Parameters are assigned by sorting them by size and dealing them
to ranks in ping-pong order (0, 1, ..., n-1, n-1, ..., 0), so memory stays balanced. Gradient norm and
zero counts are reduced over all ranks. Checkpoints use the model-space format of
:mod:`.checkpoint_state` with the owner as the one writer, so they reload under any DP size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.dist_checkpointing.dict_utils import nested_values
from megatron_core.distributed import collectives
from megatron_core.optimizer.chained_optimizer import ChainedOptimizer
from megatron_core.optimizer.clip_grads import count_zeros_fp32, get_grad_norm_fp32, grad_norm_tensor
from megatron_core.optimizer.grad_norm_groups import any_rank_has_grad_norm_group
from megatron_core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
)
from megatron_core.optimizer.optimizer_config import OptimizerConfig
from megatron_core.process_groups_config import resolve_process_group

logger = logging.getLogger(__name__)

__all__ = ["LayerWiseDistributedOptimizer", "is_managed_by_layer_wise_optimizer", "tag_params_for_buffer_routing"]

InitStateFn = Callable[[torch.optim.Optimizer], None]


def is_managed_by_layer_wise_optimizer(param: torch.nn.Parameter) -> bool:
    """True for 2-D weight matrices that are not embedding/output weights (Megatron's routing rule).

    Embeddings, the output layer, biases and norm weights are False: Megatron hands those to a separate
    element-wise optimizer when DDP splits its buffers by this tag.
    """
    return param.dim() == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


def tag_params_for_buffer_routing(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Set ``param.is_managed_by_layer_wise_optimizer`` on every trainable parameter of ``model_chunks``.

    Call it on the unwrapped chunks before :class:`~megatron_core.distributed.DistributedDataParallel`
    builds its buffers: DDP keeps tagged and untagged parameters in separate buffers.
    """
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param.requires_grad:
                param.is_managed_by_layer_wise_optimizer = is_managed_by_layer_wise_optimizer(param)


def _bucket_is_managed_by_layer_wise_optimizer(bucket: Any, default_for_untagged: bool = True) -> bool:
    """Whether a DDP bucket holds layer-wise parameters (its first param's tag; untagged: the default)."""
    params = list(getattr(bucket, "params_list", None) or getattr(bucket, "params", []))
    if not params:
        return False
    return bool(getattr(params[0], "is_managed_by_layer_wise_optimizer", default_for_untagged))


def _ping_pong_order(size: int) -> list[int]:
    return list(range(size)) + list(range(size))[::-1]


def _group(role: str, pg_collection: Any) -> Any:
    return collectives.local_if_none(resolve_process_group(role, pg_collection))


class LayerWiseDistributedOptimizer(ChainedOptimizer):
    """Chain of optimizers where each data-parallel rank updates only the whole parameters it owns.

    ``optimizers`` are plain torch optimizers built over all parameters; this class narrows their param
    groups to the local rank's share before wrapping them (``Float16OptimizerWithFloat16Params`` with
    ``config.bf16``, else ``FP32Optimizer``), so fp32 master weights and optimizer state exist only for
    owned parameters. After each inner step the updated parameters are all-gathered over the DP group
    (expert params over the expert DP group). Keep ``use_distributed_optimizer`` off with it.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], config: OptimizerConfig,
                 pg_collection: Any = None, init_state_fn_list: list[InitStateFn | None] | None = None,
                 model_chunks: list[torch.nn.Module] | None = None) -> None:
        if not optimizers:
            raise ValueError("LayerWiseDistributedOptimizer needs at least one optimizer (got an empty list)")
        for opt in optimizers:
            if isinstance(opt, MegatronOptimizer) or not isinstance(opt, torch.optim.Optimizer):
                raise TypeError("LayerWiseDistributedOptimizer expects plain torch optimizers, got "
                                f"{type(opt).__name__}; it wraps them itself after sharding")
        if init_state_fn_list and len(init_state_fn_list) != len(optimizers):
            raise ValueError(f"init_state_fn_list has {len(init_state_fn_list)} entries for "
                             f"{len(optimizers)} optimizers; they must match")
        if config.fp16:
            raise ValueError("LayerWiseDistributedOptimizer supports fp32 and bf16 only (config.fp16=True), "
                             "as in Megatron-Core")
        if config.use_distributed_optimizer:
            raise ValueError("LayerWiseDistributedOptimizer needs config.use_distributed_optimizer=False "
                             "(it shards by whole parameters itself)")
        if config.overlap_param_gather:
            raise ValueError("LayerWiseDistributedOptimizer does not support config.overlap_param_gather=True "
                             "here: updated parameters are all-gathered right after the step")
        self.pg_collection = pg_collection
        self.dp_cp = _group("dp_cp", pg_collection)
        self.expt_dp = _group("expt_dp", pg_collection)
        intra = getattr(pg_collection, "intra_dp_cp", None) if pg_collection is not None else None
        if intra is not None and get_pg_size(intra) != get_pg_size(self.dp_cp):
            raise ValueError(f"LayerWiseDistributedOptimizer does not support num_distributed_optimizer_instances "
                             f"> 1 (intra_dp_cp size {get_pg_size(intra)} != dp_cp size {get_pg_size(self.dp_cp)})")
        self.shard_params(optimizers)
        wrapped: list[MegatronOptimizer] = []
        for i, opt in enumerate(optimizers):
            init_fn = (init_state_fn_list[i] if init_state_fn_list else None) or (lambda optimizer: None)
            if config.bf16:
                wrapped.append(Float16OptimizerWithFloat16Params(opt, config, None, init_fn))
            else:
                wrapped.append(FP32Optimizer(opt, config, init_fn))
        super().__init__(wrapped)
        self.model_chunks = list(model_chunks) if model_chunks is not None else []
        self.overlap_param_gather = False
        self.use_buffer_param_sync = False

    # -- ownership -----------------------------------------------------------------------------------

    def shard_params(self, optimizers: list[torch.optim.Optimizer], full_param_layouts: Any = None) -> None:
        """Assign every parameter to one DP rank and keep only this rank's in the optimizers' groups.

        Fills ``dp_cp_params_list`` / ``expt_dp_params_list`` (rank -> owned params; ``None`` where the
        group has one rank or no expert params). ``full_param_layouts`` (Megatron's shard-aligned DDP
        buffer layouts) is not supported here and must be ``None``.
        """
        if full_param_layouts is not None:
            raise ValueError("full_param_layouts (shard-aligned DDP buffer layouts) are not supported by "
                             "megatron_core's DDP; pass None for the ping-pong assignment")
        dp_size = get_pg_size(self.dp_cp)
        if dp_size == 1:
            self.dp_cp_params_list = None
            self.expt_dp_params_list = None
            return
        self._shard_params_ping_pong(optimizers, dp_size, get_pg_size(self.expt_dp))

    def _shard_params_ping_pong(self, optimizers: list[torch.optim.Optimizer], dp_size: int,
                                expt_dp_size: int) -> None:
        groups = [g for opt in optimizers for g in opt.param_groups]
        entries = sorted(((p, i) for i, g in enumerate(groups) for p in g["params"]), key=lambda e: e[0].numel())
        self.dp_cp_params_list = [[] for _ in range(dp_size)]
        self.expt_dp_params_list = [[] for _ in range(expt_dp_size)]
        state = {False: (_ping_pong_order(dp_size), get_pg_rank(self.dp_cp), self.dp_cp_params_list),
                 True: (_ping_pong_order(expt_dp_size), get_pg_rank(self.expt_dp), self.expt_dp_params_list)}
        cursor = {False: 0, True: 0}
        local: list[list[torch.Tensor]] = [[] for _ in groups]
        for param, index in entries:
            expert = bool(groups[index].get("is_expert_parallel", False))
            order, my_rank, owners = state[expert]
            owner = order[cursor[expert]]
            cursor[expert] = (cursor[expert] + 1) % len(order)
            owners[owner].append(param)
            if owner == my_rank:
                local[index].append(param)
        for group, params in zip(groups, local):
            group["params"] = params
        if expt_dp_size == 1 or not self.expt_dp_params_list[0]:
            self.expt_dp_params_list = None

    # -- parameter sync ------------------------------------------------------------------------------

    @staticmethod
    @torch.no_grad()
    def _allgather(params_list: list[list[torch.Tensor]], group: Any) -> None:
        rank = get_pg_rank(group)
        dtypes = sorted({p.dtype for params in params_list for p in params}, key=str)
        for dtype in dtypes:  # one flat exchange per dtype; gloo needs equal sizes, so pad to the largest
            per_rank = [[p for p in params if p.dtype == dtype] for params in params_list]
            sizes = [sum(p.numel() for p in params) for params in per_rank]
            if max(sizes) == 0:
                continue
            device = next(p.device for params in per_rank for p in params)
            width = max(sizes)
            send = torch.zeros(width, dtype=dtype, device=device)
            if per_rank[rank]:
                torch.cat([p.detach().reshape(-1) for p in per_rank[rank]], out=send[:sizes[rank]])
            gathered = torch.empty(width * len(per_rank), dtype=dtype, device=device)
            collectives.all_gather(gathered, send, group)
            for owner, params in enumerate(per_rank):
                if owner == rank or not params:
                    continue
                offset = owner * width
                for p in params:
                    p.data.copy_(gathered[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def allgather_params(self) -> None:
        """Give every rank the parameters updated by their owners (one all-gather per group and dtype)."""
        if self.dp_cp_params_list:
            self._allgather(self.dp_cp_params_list, self.dp_cp)
        if self.expt_dp_params_list:
            self._allgather(self.expt_dp_params_list, self.expt_dp)

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Same result as :meth:`allgather_params` with one broadcast per parameter (a slow reference)."""
        for params_list, group in ((self.dp_cp_params_list, self.dp_cp), (self.expt_dp_params_list, self.expt_dp)):
            for owner, params in enumerate(params_list or []):
                for p in params:
                    collectives.broadcast(p.data, owner, group)

    # -- statistics over every rank ------------------------------------------------------------------

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """L2 norm of all owned gradients, summed over every rank (each parameter is owned once)."""
        return get_grad_norm_fp32(self._owned_grads_for_norm(), grad_stats_parallel_group=None)

    def _grad_norm_tensor(self) -> torch.Tensor:
        """:meth:`get_grad_norm` as a 0-dim device tensor (for clipping folded into the sub-optimizers' steps)."""
        return grad_norm_tensor(self._owned_grads_for_norm(), grad_stats_parallel_group=None).reshape(())

    def has_grad_norm_group(self, grad_norm_group: str) -> bool:
        """Whether any rank owns parameters of the group (one max all-reduce over every rank, then cached)."""
        cache = self.__dict__.setdefault("_has_grad_norm_group_cache", {})
        if grad_norm_group not in cache:
            cache[grad_norm_group] = any_rank_has_grad_norm_group(self.get_parameters(), grad_norm_group, None)
        return cache[grad_norm_group]

    def _grad_norm_of_group(self, grad_norm_group: str) -> float:
        """The group's norm over the owned gradients of every rank."""
        return get_grad_norm_fp32(self.get_grads_for_grad_norm(grad_norm_group), grad_stats_parallel_group=None)

    def _owned_grads_for_norm(self) -> list[torch.Tensor]:
        """Every sub-optimizer's gradients that count towards the norm (each parameter owned by one rank)."""
        return [g for opt in self.chained_optimizers for g in opt.get_main_grads_for_grad_norm()]

    @torch.no_grad()
    def count_zeros(self) -> float:
        """Zero gradient elements of owned parameters, summed over every rank."""
        return float(sum(count_zeros_fp32(opt.get_parameters(), None, tp_group=opt.tp_group)
                         for opt in self.chained_optimizers))

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Step the owned parameters, then all-gather them (also when chained inside another optimizer)."""
        success = super().step_with_ready_grads()
        self.allgather_params()
        return success

    # -- checkpointing -------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: Any) -> None:
        """Restore from :meth:`state_dict` (this rank's owned state) or a loaded :meth:`sharded_state_dict`.

        ``fp32_from_fp16_params`` saved as ``{index: group}`` (Megatron's sharded form) is turned back into
        a list first.
        """
        wrapped = [state_dict] if isinstance(state_dict, dict) else list(state_dict)
        for sd in wrapped:
            saved = sd.get("fp32_from_fp16_params") if isinstance(sd, dict) else None
            if isinstance(saved, dict):
                sd["fp32_from_fp16_params"] = [v for _, v in sorted(saved.items())]
        super().load_state_dict(state_dict)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           **kwargs: Any) -> dict[str, Any]:
        """Model-space optimizer state of the owned parameters, with the owner as the main replica.

        Every parameter's state lives on exactly one DP rank, so the data-parallel part of each replica id
        is reset to 0 (as Megatron-Core does); the other parts are kept. The keys do not depend on who owns
        what, so the state loads under another DP size.
        """
        sharded = super().sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        for sh in nested_values(sharded):
            replica_id = getattr(sh, "replica_id", None)
            if replica_id is None:
                continue
            if isinstance(replica_id, int):
                sh.replica_id = 0
            elif len(replica_id) == 3:
                sh.replica_id = (*replica_id[:2], 0)
            else:
                raise ValueError(f"expected replica_id as int or (PP, TP, DP) for {getattr(sh, 'key', sh)!r}, "
                                 f"got {replica_id!r}")
        return sharded

    def save_state_dict_to_file(self, filename: str) -> None:
        """``torch.save`` this rank's :meth:`state_dict` (torch format; one file per rank)."""
        torch.save(self.state_dict(), filename)

    def load_state_dict_from_file(self, filename: str) -> None:
        """Load a file written by :meth:`save_state_dict_to_file` on the same rank and DP size."""
        self.load_state_dict(torch.load(filename, weights_only=False))
