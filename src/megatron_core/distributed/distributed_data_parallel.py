"""``DistributedDataParallel``: bucketed data parallel gradient reduction (Megatron-Core's DDP wrapper).

Gradients accumulate into ``param.main_grad`` (views into contiguous buffers, see
:mod:`param_and_grad_buffer`) through post-accumulate-grad hooks, which also free ``param.grad``.
With ``overlap_grad_reduce`` a bucket's all-reduce (or reduce-scatter for the distributed
optimizer) starts as soon as its last gradient arrives; ``finish_grad_sync`` waits for them.
Dense params reduce over the DP x CP group; expert params (``param.allreduce == False``) over the
expert DP group. Gradients are pre-divided by the DP x CP size unless ``average_in_collective``.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_core import parallel_state
from megatron_core._ground import get_pg_rank, get_pg_size, register_wrapper
from megatron_core.device import get_current_device
from megatron_core.distributed import collectives
from megatron_core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_core.distributed.fp8_params import check_fp8_params_for_ddp
from megatron_core.distributed.param_and_grad_buffer import (
    _ParamAndGradBucketGroup,
    _ParamAndGradBuffer,
    compute_full_param_layout,
    group_params_for_buffers,
    partition_buckets,
)
from megatron_core.distributed.param_layout import FullParamLayout
from megatron_core.distributed.static_main_grads import (
    check_ddp_config_for_cuda_graphs,
    local_cuda_graphs_enabled,
    mark_main_grads_static,
)
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.tensor_parallel.wgrad_accumulation import BACKWARD_ADDS_TO_MAIN_GRAD

logger = logging.getLogger(__name__)


def _ddp_groups(pg_collection: Any) -> tuple[Any, Any]:
    """The (DP x CP, expert DP) groups from ``pg_collection`` or from ``parallel_state`` (the package resolver)."""
    if pg_collection is not None and getattr(pg_collection, "dp_cp", None) is None:
        raise ValueError("pg_collection passed to DistributedDataParallel must set dp_cp")
    if pg_collection is None and not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("DistributedDataParallel needs initialize_model_parallel() or a pg_collection")
    return (resolve_process_group("dp_cp", pg_collection),
            collectives.local_if_none(resolve_process_group("expt_dp", pg_collection)))


def _optimizer_instance_groups(pg_collection: Any, instances: int, dp_cp_group: Any,
                               expt_dp_group: Any) -> tuple[Any, Any, Any]:
    """``(intra DP x CP, intra expert DP, inter-instance)`` groups of the partial distributed optimizer.

    With one instance the intra groups are the full ones and there is no inter group. With more, each must be
    set up (``initialize_model_parallel(num_distributed_optimizer_instances=...)`` or the collection's
    ``intra_dp_cp`` / ``intra_expt_dp`` / ``inter_dist_opt``) and split the full group ``instances`` ways.
    """
    if instances == 1:
        return dp_cp_group, expt_dp_group, None
    groups = {role: resolve_process_group(role, pg_collection) for role in ("intra_dp_cp", "intra_expt_dp",
                                                                            "inter_dist_opt")}
    missing = sorted(role for role, group in groups.items() if group is None)
    if missing:
        raise ValueError(f"num_distributed_optimizer_instances ({instances}) > 1 needs the process groups {missing} "
                         "(initialize_model_parallel(num_distributed_optimizer_instances=...) or pg_collection)")
    for role, full in (("intra_dp_cp", dp_cp_group), ("intra_expt_dp", expt_dp_group)):
        if get_pg_size(groups[role]) * instances != get_pg_size(full):
            raise ValueError(f"num_distributed_optimizer_instances ({instances}): the {role} group has "
                             f"{get_pg_size(groups[role])} ranks, but the full group has {get_pg_size(full)} "
                             f"(expected {get_pg_size(full) // instances})")
    if get_pg_size(groups["inter_dist_opt"]) != instances:
        raise ValueError(f"num_distributed_optimizer_instances ({instances}): the inter_dist_opt group has "
                         f"{get_pg_size(groups['inter_dist_opt'])} ranks (expected one per instance)")
    return groups["intra_dp_cp"], groups["intra_expt_dp"], groups["inter_dist_opt"]


def _check_layout_matches(buffer_groups: dict, full_param_layout: FullParamLayout) -> None:
    """A precomputed layout must place exactly the parameters DDP groups into each buffer."""
    if set(buffer_groups) != set(full_param_layout.layouts):
        raise ValueError(f"full_param_layout has buffers {sorted(map(str, full_param_layout.layouts))}, but the "
                         f"module's parameters group into {sorted(map(str, buffer_groups))}")
    for key, (params, param_indices) in buffer_groups.items():
        layout = full_param_layout.layouts[key]
        if set(params) != set(layout.param_index_map) or param_indices != layout.param_indices:
            raise ValueError(f"full_param_layout's buffer {key} does not place the module's parameters of that buffer")


@register_wrapper
class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` so its gradients are reduced across data parallel ranks in buckets.

    ``config`` is the model's ``TransformerConfig`` (or ``ModelParallelConfig``); only
    ``calculate_per_token_loss`` is read from it. ``disable_bucketing`` puts every param of a
    buffer into one bucket.
    """

    def __init__(self, config: Any, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                 disable_bucketing: bool = False, pg_collection: Any = None,
                 full_param_layout: FullParamLayout | None = None) -> None:
        super().__init__()
        check_ddp_config_for_cuda_graphs(config, ddp_config)
        self.config = config
        self.ddp_config = ddp_config
        self.module = module
        self.dp_cp_group, self.expt_dp_group = _ddp_groups(pg_collection)
        # Gradients are reduce-scattered over the intra groups, then each shard all-reduced across instances.
        self.intra_dp_cp_group, self.intra_expt_dp_group, self.inter_dist_opt_group = _optimizer_instance_groups(
            pg_collection, ddp_config.num_distributed_optimizer_instances, self.dp_cp_group, self.expt_dp_group)
        dp_cp_size = get_pg_size(self.dp_cp_group)
        if get_pg_rank(self.dp_cp_group) == 0:
            logger.info("Setting up DistributedDataParallel with config %s", ddp_config)
        expt_dp_size = get_pg_size(self.expt_dp_group)

        self.bucket_size = ddp_config.bucket_size
        if ddp_config.bucket_size is None and ddp_config.overlap_grad_reduce:
            self.bucket_size = max(40_000_000, 1_000_000 * dp_cp_size)
        if not ddp_config.overlap_grad_reduce and ddp_config.bucket_size is None:
            self.bucket_size = None
        if ddp_config.num_buckets is not None:
            total = sum(p.numel() for p in module.parameters() if p.requires_grad)
            self.bucket_size = max(1, math.ceil(total / ddp_config.num_buckets))
        if disable_bucketing:
            self.bucket_size = None

        if getattr(config, "calculate_per_token_loss", False):
            scaling, expert_scaling = 1.0, 1.0
        elif ddp_config.average_in_collective:
            scaling, expert_scaling = 1.0, expt_dp_size / dp_cp_size
        else:
            scaling, expert_scaling = 1.0 / dp_cp_size, 1.0 / dp_cp_size

        self.param_to_name: dict[torch.nn.Parameter, str] = {}
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            self.param_to_name[param] = name
            param.grad_added_to_main_grad = False
        all_params = list(self.param_to_name)
        check_fp8_params_for_ddp(all_params, ddp_config)
        buffer_groups = group_params_for_buffers(all_params, ddp_config.grad_reduce_in_fp32)
        if full_param_layout is None and ddp_config.use_distributed_optimizer:
            full_param_layout = compute_full_param_layout(
                all_params, self.bucket_size, get_pg_size(self.intra_dp_cp_group), ddp_config,
                expert_data_parallel_world_size=get_pg_size(self.intra_expt_dp_group))
        if full_param_layout is not None:
            _check_layout_matches(buffer_groups, full_param_layout)
        self.full_param_layout = full_param_layout

        device = get_current_device()
        self.buffers, self.expert_parallel_buffers = [], []
        for key, (params, param_indices) in buffer_groups.items():
            group, factor = (self.intra_expt_dp_group, expert_scaling) if key.is_expert_parallel \
                else (self.intra_dp_cp_group, scaling)
            buffer = _ParamAndGradBuffer(
                ddp_config, key.param_dtype, key.grad_dtype, [(p, self.param_to_name[p]) for p in params], group,
                self.bucket_size, self.param_to_name, factor, param_indices,
                param_layout=full_param_layout.layouts[key] if full_param_layout is not None else None,
                device=device)
            (self.expert_parallel_buffers if key.is_expert_parallel else self.buffers).append(buffer)
        self.bucket_groups = partition_buckets(self.buffers, force_single_bucket_group=disable_bucketing)
        self.expert_parallel_bucket_groups = partition_buckets(
            self.expert_parallel_buffers, force_single_bucket_group=disable_bucketing
        )
        for group in self.bucket_groups + self.expert_parallel_bucket_groups:
            group.inter_distributed_optimizer_instance_group = self.inter_dist_opt_group
        # Forward needs the buckets in reverse (creation) order: chain each group to the one before it.
        all_groups = self.bucket_groups + self.expert_parallel_bucket_groups
        for groups in (self.bucket_groups, self.expert_parallel_bucket_groups):
            for i in range(len(groups) - 1, 0, -1):
                groups[i].next_param_gather_bucket_group = groups[i - 1]
        self.param_to_bucket_group: dict[torch.nn.Parameter, _ParamAndGradBucketGroup] = {
            param: group for group in all_groups for param in group.params
        }

        if local_cuda_graphs_enabled(config):  # layers recorded as CUDA graphs write these views in place
            mark_main_grads_static(self.param_to_name)
        self._grad_hook_handles = [
            param.register_post_accumulate_grad_hook(self._make_backward_post_hook(param))
            for param in self.param_to_name if not getattr(param, "skip_backward_post_hook", False)
        ]
        self._register_delayed_wgrad_hooks()
        self.use_forward_hook = ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather
        self._forward_hook_handles: list = []
        if self.use_forward_hook:
            self.enable_forward_pre_hook()

    def _register_delayed_wgrad_hooks(self) -> None:
        """A weight whose gradient is deferred to its layer's ``backward_dw()`` (``delay_wgrad_compute``, marked
        ``skip_backward_post_hook``) gets no gradient from autograd: its grad-ready hook runs from the layer's
        ``backward_dw()`` instead, so its bucket is reduced only after the deferred GEMM."""
        deferred = {param for param in self.param_to_name if getattr(param, "skip_backward_post_hook", False)}
        for module in self.module.modules():
            if not hasattr(module, "register_wgrad_accumulation_and_reduce_hooks"):
                continue
            for param in module.parameters(recurse=False):
                if param in deferred:
                    deferred.discard(param)
                    hook = self._make_backward_post_hook(param)
                    module.register_wgrad_accumulation_and_reduce_hooks(functools.partial(hook, param))
        if deferred:
            names = sorted(self.param_to_name[p] for p in deferred)
            raise ValueError(f"parameters {names} are marked skip_backward_post_hook (delayed weight gradient) but "
                             "no module owning them has register_wgrad_accumulation_and_reduce_hooks")

    def _make_backward_post_hook(self, param: torch.nn.Parameter) -> Callable[[torch.Tensor], None]:
        # The hook lives in the parameter's autograd metadata, which Python's garbage collector cannot see: a
        # strong reference to this wrapper (or to ``param``) from it would be a cycle the collector never frees,
        # keeping the model, its buffers and its process groups (gloo threads and sockets) alive for the
        # process's lifetime. The wrapper is held weakly and the parameter comes in as the hook's argument.
        ddp_ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            # A fused weight-gradient GEMM already wrote into main_grad (flag set by the backward, or the
            # layer's static mark inside compiled graphs); .grad is then a dummy, unless zero_out_wgrad.
            fused = p.grad_added_to_main_grad or getattr(p, "wgrad_fused_into_main_grad", False) \
                or getattr(p, BACKWARD_ADDS_TO_MAIN_GRAD, False)
            if p.grad is not None and (not fused or getattr(p, "zero_out_wgrad", False)):
                p.main_grad.add_(p.grad)
            p.grad = None
            ddp = ddp_ref()
            if ddp is not None and ddp.ddp_config.overlap_grad_reduce:
                ddp.param_to_bucket_group[p].register_grad_ready(p)

        return hook

    def _make_forward_pre_hook(self) -> Callable[..., None]:
        def hook(module: torch.nn.Module, *unused: Any) -> None:
            for param in module.parameters(recurse=False):
                group = self.param_to_bucket_group.get(param)
                if group is not None:
                    group.finish_param_sync(skip_next_bucket_dispatch=self.ddp_config.align_param_gather)

        return hook

    def enable_forward_pre_hook(self) -> None:
        """Wait for each module's parameter all-gather just before its forward (distributed optimizer)."""
        if not self.use_forward_hook:
            raise RuntimeError("forward pre-hooks need use_distributed_optimizer and overlap_param_gather")
        if not self._forward_hook_handles:
            self._forward_hook_handles = [m.register_forward_pre_hook(self._make_forward_pre_hook())
                                          for m in self.module.modules()]

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Remove the forward pre-hooks; with ``param_sync`` gather every parameter now."""
        for handle in self._forward_hook_handles:
            handle.remove()
        self._forward_hook_handles = []
        if param_sync:
            self.start_param_sync(force_sync=True)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Call the wrapped module."""
        return self.module(*inputs, **kwargs)

    def _all_bucket_groups(self) -> list[_ParamAndGradBucketGroup]:
        return self.bucket_groups + self.expert_parallel_bucket_groups

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (all but the last microbatch)."""
        for group in self._all_bucket_groups():
            group.is_last_microbatch = False
        try:
            yield
        finally:
            for group in self._all_bucket_groups():
                group.is_last_microbatch = True

    def start_grad_sync(self, *unused: Any) -> None:
        """Launch the reduction of every bucket (asynchronously when ``overlap_grad_reduce``)."""
        for group in self._all_bucket_groups():
            group.start_grad_sync()

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Wait for (or run) every bucket's reduction; afterwards ``main_grad`` holds the reduced gradient."""
        for group in self._all_bucket_groups():
            group.finish_grad_sync(force_all_reduce=force_all_reduce)

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """All-gather the distributed optimizer's updated shards into the params.

        Without ``overlap_param_gather`` (or with ``force_sync``) this is synchronous; otherwise it
        dispatches the gathers and the forward pre-hooks wait for them.
        """
        if not self.ddp_config.use_distributed_optimizer:
            return
        for group in self._all_bucket_groups():
            if force_dispatch and group.param_gather_dispatched and not force_sync:
                continue
            group.start_param_sync(force_sync=force_sync)

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` and forget ready gradients; call before each iteration.

        With ``overwrite_main_grad_on_first_wgrad`` the ``main_grad`` of fused-wgrad weights is left to its first
        weight-gradient GEMM instead (see :mod:`.param_and_grad_buffer`).
        """
        for param in self.param_to_name:
            param.grad_added_to_main_grad = False
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.reset()
        for group in self._all_bucket_groups():
            group.reset()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every ``main_grad`` by ``scaling_factor``."""
        for buffer in self.buffers + self.expert_parallel_buffers:
            buffer.scale_gradients(scaling_factor)

    def broadcast_params(self) -> None:
        """Copy data parallel rank 0's parameters to every other data parallel rank."""
        for param in self.module.parameters():
            group = self.dp_cp_group if getattr(param, "allreduce", True) else self.expt_dp_group
            collectives.broadcast(param.data, 0, group)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict (DDP adds no keys)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load into the wrapped module."""
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, prefix: str = "", *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's sharded state dict (for ``dist_checkpointing``)."""
        return self.module.sharded_state_dict(prefix, *args, **kwargs)
