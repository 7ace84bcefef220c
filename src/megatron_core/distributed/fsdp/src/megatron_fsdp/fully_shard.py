"""``fully_shard``: Megatron-FSDP for any ``torch.nn.Module`` (0.19's ``megatron_fsdp.fully_shard``).

``fully_shard_model`` wraps a module in :class:`~.megatron_fsdp.MegatronFSDP` (PyTorch FSDP2 underneath),
``fully_shard_optimizer`` extends an optimizer built on the wrapped parameters so that ``step`` ends the
gradient synchronisation first and ``zero_grad`` also clears the model's gradients, and ``fully_shard``
does both, re-pointing the given optimizer's parameter groups at the sharded parameters.

Served: ``zero_dp_strategy`` 0-3 (or their names), HSDP over ``dp_outer_dim`` with
``outer_dp_sharding_strategy`` 0 (replicate), ``MixedPrecisionPolicy``, meta-device initialisation,
``sync_model_each_microbatch``, ``calculate_per_token_loss``. Refused with a ``ValueError`` naming the
argument: ``outer_dp_sharding_strategy`` 1 (FSDP2 cannot shard optimizer state across replicas), expert
meshes and groups, separate all-gather groups, and the Megatron-FSDP allocator / Transformer Engine /
CUDA-graph options (``nccl_ub``, ``fsdp_double_buffer``, ``keep_fp8_transpose_cache``, ...). The tuning
knobs ``overlap_grad_reduce``, ``overlap_param_gather``, ``disable_bucketing``, ``average_in_collective``
(FSDP2 averages either way), ``fsdp_db_use_persist_buf_on_alloc_fail`` and
``disable_symmetric_registration`` are accepted.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_core.device import get_current_device
from megatron_core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP
from megatron_core.distributed.fsdp.src.megatron_fsdp.mixed_precision import (
    DEFAULT_POLICY,
    MixedPrecisionPolicy,
)
from megatron_core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex

__all__ = ["MixedPrecisionPolicy", "ShardingStrategy", "experimental_api", "fully_shard", "fully_shard_model",
           "fully_shard_optimizer"]


class ShardingStrategy(IntEnum):
    """Megatron-FSDP's sharding strategies by number: what each data-parallel rank keeps only a shard of."""

    NO_SHARD = 0
    """Nothing sharded (DDP)."""
    OPTIM = 1
    """Optimizer state and main weights (ZeRO-1)."""
    OPTIM_GRADS = 2
    """Optimizer state and gradients (ZeRO-2)."""
    OPTIM_GRADS_PARAMS = 3
    """Optimizer state, gradients and parameters (ZeRO-3)."""


def experimental_api(func: Callable) -> Callable:
    """Mark ``func`` as experimental (sets ``func._experimental_api``); it still runs normally."""
    func._experimental_api = True
    return func


_NAMES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_REFUSED = {
    "keep_fp8_transpose_cache": "FP8 transpose caches belong to Transformer Engine parameters in Megatron-FSDP's "
                                "own buffers",
    "nccl_ub": "NCCL user buffers need Megatron-FSDP's own allocator",
    "fsdp_double_buffer": "persistent double buffers belong to Megatron-FSDP's own allocator",
    "enable_fine_grained_param_gather": "FSDP2 gathers one unit at a time, not per sub-module",
    "use_decoupled_grad": "FSDP2 writes reduced gradients into param.grad (Transformer Engine's FusedAdam "
                          "decoupled gradients are not served)",
    "cuda_graph_mode": "FSDP2's hooks are not CUDA-graph safe",
    "maxpool_double_buffer": "a double-buffer allocator of Megatron-FSDP's own",
    "hybrid_fsdp_expt_group": "expert parallelism is not served by fully_shard here",
    "expt_device_mesh": "expert parallelism is not served by fully_shard here",
    "fsdp_group_ag": "FSDP2 all-gathers on its own stream over the shard group",
    "expt_fsdp_group_ag": "expert parallelism is not served by fully_shard here",
}


def _strategy_name(value: str | int, argument: str, allowed: tuple[str, ...]) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(_NAMES):
        value = _NAMES[value]
    if value not in allowed:
        numbers = [_NAMES.index(name) for name in allowed]
        raise ValueError(f"{argument} ({value!r}) must be one of {numbers} or {list(allowed)}")
    return value


def _default_mesh(dp_shard_dim: str | None, tp_dim: str | None) -> tuple[DeviceMesh, str, str]:
    """0.19's default: a ``(world, 1)`` mesh named ``(fsdp, tp)`` on the current device type."""
    dp_shard_dim, tp_dim = dp_shard_dim or "fsdp", tp_dim or "tp"
    mesh = init_device_mesh(get_current_device().type, (dist.get_world_size(), 1),
                            mesh_dim_names=(dp_shard_dim, tp_dim))
    return mesh, dp_shard_dim, tp_dim


@experimental_api
def fully_shard_model(
    module: torch.nn.Module, device_mesh: DeviceMesh | None = None, dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None, tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None, hybrid_fsdp_expt_group: dist.ProcessGroup | None = None,
    expt_device_mesh: DeviceMesh | None = None, fsdp_group_ag: dist.ProcessGroup | None = None,
    expt_fsdp_group_ag: dist.ProcessGroup | None = None,
    fsdp_unit_modules: Sequence[type[torch.nn.Module]] | Sequence[str] | None = None,
    zero_dp_strategy: str | int = 3, outer_dp_sharding_strategy: str | int = 0,
    device: torch.device | None = None, init_model_with_meta_device: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy = DEFAULT_POLICY, overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True, sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True, report_nan_in_param_grad: bool = False,
    average_in_collective: bool = False, disable_bucketing: bool = False, calculate_per_token_loss: bool = False,
    keep_fp8_transpose_cache: bool = False, nccl_ub: bool = False, fsdp_double_buffer: bool = False,
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False, disable_symmetric_registration: bool = False,
    enable_fine_grained_param_gather: bool = False, use_decoupled_grad: bool = False,
    cuda_graph_mode: bool = False, maxpool_double_buffer: bool = False,
) -> MegatronFSDP:
    """Shard ``module`` with Megatron-FSDP's arguments and return the :class:`MegatronFSDP` wrapping it.

    ``device_mesh`` holds the named dimensions ``dp_shard_dim`` (sharding), ``dp_outer_dim`` (HSDP replicas,
    together with ``hybrid_fsdp_group`` spanning both) and ``tp_dim``; without a mesh every rank shards
    (``dp_outer_dim`` is then ignored, as in 0.19). ``zero_dp_strategy``: 0 ``no_shard``, 1 ``optim``,
    2 ``optim_grads``, 3 ``optim_grads_params``. See the module docstring for what is refused.
    """
    options = {"keep_fp8_transpose_cache": keep_fp8_transpose_cache, "nccl_ub": nccl_ub,
               "fsdp_double_buffer": fsdp_double_buffer,
               "enable_fine_grained_param_gather": enable_fine_grained_param_gather,
               "use_decoupled_grad": use_decoupled_grad, "cuda_graph_mode": cuda_graph_mode,
               "maxpool_double_buffer": maxpool_double_buffer, "hybrid_fsdp_expt_group": hybrid_fsdp_expt_group,
               "expt_device_mesh": expt_device_mesh, "fsdp_group_ag": fsdp_group_ag,
               "expt_fsdp_group_ag": expt_fsdp_group_ag}
    for name, value in options.items():
        if value is not None and value is not False:
            raise ValueError(f"fully_shard: {name}={value!r} is not supported on PyTorch FSDP2: {_REFUSED[name]}")
    if device_mesh is None:
        device_mesh, dp_shard_dim, tp_dim = _default_mesh(dp_shard_dim, tp_dim)
        dp_outer_dim, hybrid_fsdp_group, outer_dp_sharding_strategy = None, None, 0
    strategy = _strategy_name(zero_dp_strategy, "zero_dp_strategy", _NAMES)
    outer = _strategy_name(outer_dp_sharding_strategy, "outer_dp_sharding_strategy", _NAMES[:2])
    if outer == "optim" and strategy != "optim_grads_params":
        raise ValueError(f"outer_dp_sharding_strategy='optim' needs zero_dp_strategy='optim_grads_params' (3), "
                         f"got {strategy!r}")
    if outer == "optim":
        raise ValueError("outer_dp_sharding_strategy='optim' (1, optimizer state sharded across dp_outer) is not "
                         "supported on PyTorch FSDP2, which replicates across the outer dimension; use 0")
    if (dp_outer_dim is None) != (hybrid_fsdp_group is None):
        raise ValueError(f"dp_outer_dim ({dp_outer_dim!r}) and hybrid_fsdp_group ({hybrid_fsdp_group}) must be "
                         "given together (HSDP) or both left None")
    if dp_shard_dim is None:
        raise ValueError("dp_shard_dim must name a dimension of device_mesh")
    if init_model_with_meta_device and strategy == "no_shard":
        raise ValueError("init_model_with_meta_device=True is not supported with zero_dp_strategy='no_shard' (0)")
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy, outer_dp_sharding_strategy=outer,
        overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
        average_in_collective=average_in_collective,
        fsdp_db_use_persist_buf_on_alloc_fail=fsdp_db_use_persist_buf_on_alloc_fail,
        disable_symmetric_registration=disable_symmetric_registration)
    dist_index = FSDPDistributedIndex(device_mesh, dp_shard_dim=dp_shard_dim, dp_outer_dim=dp_outer_dim,
                                      tp_dim=tp_dim, hybrid_fsdp_group=hybrid_fsdp_group)
    if dist_index.use_hybrid_fsdp:
        expected = device_mesh[dp_outer_dim].size() * device_mesh[dp_shard_dim].size()
        if hybrid_fsdp_group.size() != expected:
            raise ValueError(f"hybrid_fsdp_group has {hybrid_fsdp_group.size()} ranks, expected {expected} "
                             f"(dp_outer_dim {dp_outer_dim!r} x dp_shard_dim {dp_shard_dim!r})")
    model = MegatronFSDP(module, dist_index, ddp_config=ddp_config, mixed_precision_policy=mixed_precision_policy,
                         fsdp_unit_modules=fsdp_unit_modules, disable_bucketing=disable_bucketing, device=device,
                         calculate_per_token_loss=calculate_per_token_loss,
                         init_model_with_meta_device=init_model_with_meta_device,
                         sync_model_each_microbatch=sync_model_each_microbatch,
                         report_nan_in_param_grad=report_nan_in_param_grad)
    if preproc_state_dict_for_dcp_ckpt and strategy != "no_shard":
        model._register_state_dict_hook(_drop_extra_state)
    return model


def _drop_extra_state(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """Remove Transformer Engine ``_extra_state`` entries (FP8 metadata), which 0.19 does not checkpoint here."""
    for key in [k for k in state_dict if k.endswith("_extra_state")]:
        state_dict.pop(key)


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """Create every parameter's optimizer state now (DCP loads into existing state) without changing anything:
    one step with zero gradients, learning rate and weight decay, then the step counters set back to 0."""
    saved = [(group.get("lr"), group.get("weight_decay")) for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0 if not isinstance(group.get("lr"), torch.Tensor) else group["lr"] * 0
        if "weight_decay" in group:
            group["weight_decay"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    type(optimizer).step(optimizer)
    for group, (lr, weight_decay) in zip(optimizer.param_groups, saved):
        group["lr"] = lr
        if weight_decay is not None:
            group["weight_decay"] = weight_decay
        for param in group["params"]:
            param.grad = None
    for state in optimizer.state.values():
        if "step" in state:
            if isinstance(state["step"], torch.Tensor):
                state["step"].zero_()
            else:
                state["step"] = 0


@experimental_api
def fully_shard_optimizer(optimizer: torch.optim.Optimizer,
                          preproc_state_dict_for_dcp_ckpt: bool = True) -> torch.optim.Optimizer:
    """Extend ``optimizer`` (built on a :class:`MegatronFSDP` model's parameters) in place and return it.

    Its state is created up front, for ``torch.distributed.checkpoint`` to load into (0.19 does the same;
    here without moving a weight or counting a step). ``step(sync_grad_before_optimizer_step=True,
    install_optimized_model_weights=True)`` first ends the gradient synchronisation unless the model syncs
    every microbatch; ``zero_grad(zero_grad_buffer=True)`` also clears the model's gradients. The state dict's
    DTensors are ``torch.distributed.checkpoint``-ready as they are (``preproc_state_dict_for_dcp_ckpt`` is
    accepted for 0.19's signature).
    """
    if not optimizer.param_groups or not optimizer.param_groups[0]["params"]:
        raise ValueError(f"fully_shard_optimizer: the optimizer has no parameters: {optimizer}")
    first = optimizer.param_groups[0]["params"][0]
    model = getattr(first, "_megatron_fsdp_model", None)
    if model is None:
        raise ValueError("fully_shard_optimizer: the optimizer's first parameter does not belong to a MegatronFSDP "
                         "model; build the optimizer on fully_shard_model(...).parameters()")
    base_step, base_zero_grad = type(optimizer).step, type(optimizer).zero_grad
    _create_state(optimizer)

    def step(self: torch.optim.Optimizer, *args: Any, sync_grad_before_optimizer_step: bool = True,
             install_optimized_model_weights: bool = True, **kwargs: Any) -> Any:
        if sync_grad_before_optimizer_step and not model.model_auto_sync:
            model.finish_grad_sync()
        result = base_step(self, *args, **kwargs)
        if install_optimized_model_weights:
            model.install_optimized_model_weights()
        return result

    def zero_grad(self: torch.optim.Optimizer, *args: Any, zero_grad_buffer: bool = True, **kwargs: Any) -> None:
        base_zero_grad(self, *args, **kwargs)
        if zero_grad_buffer:
            model.zero_grad_buffer()

    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    return optimizer


@experimental_api
def fully_shard(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None, dp_outer_dim: str | None = None, tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None, hybrid_fsdp_expt_group: dist.ProcessGroup | None = None,
    expt_device_mesh: DeviceMesh | None = None, fsdp_group_ag: dist.ProcessGroup | None = None,
    expt_fsdp_group_ag: dist.ProcessGroup | None = None,
    fsdp_unit_modules: Sequence[type[torch.nn.Module]] | Sequence[str] | None = None,
    zero_dp_strategy: str | int = 3, outer_dp_sharding_strategy: str | int = 0,
    device: torch.device | None = None, init_model_with_meta_device: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy = DEFAULT_POLICY, overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True, sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True, report_nan_in_param_grad: bool = False,
    average_in_collective: bool = False, disable_bucketing: bool = False, calculate_per_token_loss: bool = False,
    keep_fp8_transpose_cache: bool = False, nccl_ub: bool = False, fsdp_double_buffer: bool = False,
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False, disable_symmetric_registration: bool = False,
    enable_fine_grained_param_gather: bool = False, use_decoupled_grad: bool = False,
    cuda_graph_mode: bool = False, maxpool_double_buffer: bool = False,
) -> tuple[MegatronFSDP, torch.optim.Optimizer]:
    """``(model, optimizer)``: :func:`fully_shard_model` of ``module``, and ``optimizer`` re-pointed at the sharded
    parameters and extended by :func:`fully_shard_optimizer`.

    Each parameter group keeps its options (0.19 rebuilds a single group from the optimizer's defaults;
    the two agree for a single-group optimizer); its existing state is dropped, as in 0.19.
    """
    names = {id(p): name for name, p in module.named_parameters()}
    group_names = [[names[id(p)] for p in group["params"] if id(p) in names] for group in optimizer.param_groups]
    model = fully_shard_model(
        module, device_mesh=device_mesh, dp_shard_dim=dp_shard_dim, dp_outer_dim=dp_outer_dim, tp_dim=tp_dim,
        hybrid_fsdp_group=hybrid_fsdp_group, hybrid_fsdp_expt_group=hybrid_fsdp_expt_group,
        expt_device_mesh=expt_device_mesh, fsdp_group_ag=fsdp_group_ag, expt_fsdp_group_ag=expt_fsdp_group_ag,
        fsdp_unit_modules=fsdp_unit_modules, zero_dp_strategy=zero_dp_strategy,
        outer_dp_sharding_strategy=outer_dp_sharding_strategy, device=device,
        init_model_with_meta_device=init_model_with_meta_device, mixed_precision_policy=mixed_precision_policy,
        overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
        sync_model_each_microbatch=sync_model_each_microbatch,
        preproc_state_dict_for_dcp_ckpt=preproc_state_dict_for_dcp_ckpt,
        report_nan_in_param_grad=report_nan_in_param_grad, average_in_collective=average_in_collective,
        disable_bucketing=disable_bucketing, calculate_per_token_loss=calculate_per_token_loss,
        keep_fp8_transpose_cache=keep_fp8_transpose_cache, nccl_ub=nccl_ub, fsdp_double_buffer=fsdp_double_buffer,
        fsdp_db_use_persist_buf_on_alloc_fail=fsdp_db_use_persist_buf_on_alloc_fail,
        disable_symmetric_registration=disable_symmetric_registration,
        enable_fine_grained_param_gather=enable_fine_grained_param_gather, use_decoupled_grad=use_decoupled_grad,
        cuda_graph_mode=cuda_graph_mode, maxpool_double_buffer=maxpool_double_buffer)
    sharded = dict(model.module.named_parameters())
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [sharded[n] for n in group_params]}
              for group, group_params in zip(optimizer.param_groups, group_names)]
    groups = [group for group in groups if group["params"]]
    covered = {n for group_params in group_names for n in group_params}
    rest = [p for n, p in sharded.items() if n not in covered]
    optimizer.param_groups.clear()
    optimizer.state.clear()
    for group in groups:
        optimizer.add_param_group(group)
    if rest:
        optimizer.add_param_group({"params": rest})
    fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt=preproc_state_dict_for_dcp_ckpt)
    return model, optimizer
