"""``MegatronFSDP``: 0.19's Megatron-FSDP module wrapper, with PyTorch FSDP2 as the sharding runtime.

0.19's ``MegatronFSDP`` runs its own buffers and hooks; here the wrapped module is sharded with
``torch.distributed.fsdp.fully_shard`` (``fsdp2_units``) and this class keeps 0.19's surface: ``module``,
``sync`` / ``no_sync`` / ``set_model_auto_sync``, ``finish_grad_sync``, ``zero_grad_buffer``, ``state_dict``
(DTensor values, loadable with ``torch.distributed.checkpoint``), ... FSDP2 gathers and reduces inside
forward and backward, so the methods that start or wait for communication have nothing left to do.

Gradient synchronisation follows 0.19: a backward reduces gradients when ``model_auto_sync`` is on
(``sync_model_each_microbatch``) or after a ``no_sync()`` block has ended (``is_last_microbatch``);
otherwise gradients accumulate. ``no_shard`` and ``optim`` then keep unreduced (and, as in 0.19, whole)
gradients (FSDP2 ``set_requires_gradient_sync(False)``); ``optim_grads`` and ``optim_grads_params``
reduce-scatter every backward as 0.19 does, and only the HSDP all-reduce across ``dp_outer`` waits
(``set_requires_all_reduce(False)``). Unlike 0.19, the reduce-scattered shards of those two strategies
are visible in ``param.grad`` before ``finish_grad_sync``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_core.device import get_current_device
from megatron_core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_core.distributed.fsdp.src.megatron_fsdp.fsdp2_units import (
    cast_parameters,
    fsdp2_mesh,
    materialize_meta_module,
    shard_units,
)
from megatron_core.distributed.fsdp.src.megatron_fsdp.mixed_precision import (
    DEFAULT_POLICY,
    MixedPrecisionPolicy,
    torch_mixed_precision,
)
from megatron_core.distributed.fsdp.src.megatron_fsdp.utils import (
    FSDPDistributedIndex,
    import_class_from_path,
)

__all__ = ["MegatronFSDP", "TrainingState"]

_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_UNSUPPORTED_FLAGS = {
    "keep_fp8_transpose_cache": "FP8 transpose caches belong to Transformer Engine parameters in Megatron-FSDP's "
                                "own buffers",
    "nccl_ub": "NCCL user buffers need Megatron-FSDP's own allocator",
    "fsdp_double_buffer": "persistent double buffers belong to Megatron-FSDP's own allocator",
    "enable_fine_grained_param_gather_hook": "FSDP2 gathers one unit at a time, not per sub-module",
    "enable_fine_grained_param_gather_backward_hook": "FSDP2 gathers one unit at a time, not per sub-module",
}


class TrainingState(Enum):
    """Where a Megatron-FSDP module is in its step (``MegatronFSDP.training_state``)."""

    FORWARD = auto()
    """Inside the wrapped module's forward."""
    PRE_BACKWARD = auto()
    """Between forward and backward (0.19 tracks this per parameter group; FSDP2 does it internally here)."""
    POST_BACKWARD = auto()
    """Gradients being reduced (0.19; FSDP2 does it internally here)."""
    IDLE = auto()
    """Outside forward."""


def _refuse(flags: dict[str, Any]) -> None:
    for name, value in flags.items():
        if value:
            raise ValueError(f"{name}={value!r} is not supported by MegatronFSDP on PyTorch FSDP2: "
                             f"{_UNSUPPORTED_FLAGS[name]}")


def _compute_dtype(module: torch.nn.Module) -> torch.dtype:
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if len(dtypes) > 1:
        raise ValueError(f"MegatronFSDP needs one floating-point parameter dtype, got {sorted(map(str, dtypes))}")
    return dtypes.pop() if dtypes else torch.float32


class MegatronFSDP(torch.nn.Module):
    """Shard ``module`` over ``dist_index``'s data-parallel mesh with FSDP2 (see the module docstring).

    ``ddp_config.data_parallel_sharding_strategy`` picks the strategy (default ``optim_grads_params``);
    ``fsdp_unit_modules`` (classes or dotted class paths) become their own FSDP2 units, gathered around
    their forward and backward; the root module is always one. ``init_model_with_meta_device``: ``module`` was
    built on the meta device; each rank allocates its shards and runs the modules' ``reset_parameters``.
    ``calculate_per_token_loss`` sums gradients over ranks instead of averaging them.
    ``report_nan_in_param_grad`` makes ``finish_grad_sync`` raise on NaN gradients.
    """

    def __init__(self, module: torch.nn.Module, dist_index: FSDPDistributedIndex,
                 ddp_config: DistributedDataParallelConfig | None = None,
                 mixed_precision_policy: MixedPrecisionPolicy = DEFAULT_POLICY,
                 fsdp_unit_modules: Sequence[type | str] | None = None, disable_bucketing: bool = False,
                 device: torch.device | None = None, calculate_per_token_loss: bool = False,
                 init_model_with_meta_device: bool = False, sync_model_each_microbatch: bool = False,
                 keep_fp8_transpose_cache: bool = False, nccl_ub: bool = False, fsdp_double_buffer: bool = False,
                 fsdp_db_use_persist_buf_on_alloc_fail: bool = False, disable_symmetric_registration: bool = False,
                 enable_fine_grained_param_gather_hook: bool = False,
                 enable_fine_grained_param_gather_backward_hook: bool = False,
                 fine_grained_recurse_module_types: tuple[type, ...] | None = None,
                 report_nan_in_param_grad: bool = False) -> None:
        super().__init__()
        _refuse({"keep_fp8_transpose_cache": keep_fp8_transpose_cache, "nccl_ub": nccl_ub,
                 "fsdp_double_buffer": fsdp_double_buffer,
                 "enable_fine_grained_param_gather_hook": enable_fine_grained_param_gather_hook,
                 "enable_fine_grained_param_gather_backward_hook": enable_fine_grained_param_gather_backward_hook})
        if ddp_config is None:
            ddp_config = DistributedDataParallelConfig(
                use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
                overlap_grad_reduce=True, overlap_param_gather=True)
        strategy = ddp_config.data_parallel_sharding_strategy
        if strategy not in _STRATEGIES:
            raise ValueError(f"data_parallel_sharding_strategy ({strategy!r}) must be one of {_STRATEGIES}")
        if any(not getattr(p, "allreduce", True) for p in module.parameters()):
            raise ValueError("MegatronFSDP on FSDP2 does not serve expert-parallel parameters (allreduce=False)")
        self.ddp_config = ddp_config
        self.data_parallel_sharding_strategy = strategy
        self.dist_index = dist_index
        self.mp_policy = mixed_precision_policy
        self.calculate_per_token_loss = calculate_per_token_loss
        self.init_model_with_meta_device = init_model_with_meta_device
        self.report_nan_in_param_grad = report_nan_in_param_grad
        self.fine_grained_recurse_module_types = tuple(fine_grained_recurse_module_types or ())
        self.device = torch.device(device) if device is not None else get_current_device()
        self.fsdp_unit_modules = [import_class_from_path(c) if isinstance(c, str) else c
                                  for c in (fsdp_unit_modules or [])]
        if strategy in ("optim_grads", "optim_grads_params"):
            ddp_config.overlap_grad_reduce = True  # as 0.19: these strategies reduce during backward
        if strategy == "optim_grads_params":
            ddp_config.overlap_param_gather = True
        self.set_model_auto_sync(sync_model_each_microbatch)
        self.is_last_microbatch = False
        self.microbatch_count = 0
        self.training_state = TrainingState.IDLE
        self._unreduced_grads = False

        if not init_model_with_meta_device:
            module.to(self.device)
        main_dtype, torch_policy = torch_mixed_precision(mixed_precision_policy, _compute_dtype(module))
        cast_parameters(module, main_dtype)
        mesh = fsdp2_mesh(dist_index, strategy)
        self.units = shard_units(module, self.fsdp_unit_modules, mesh,
                                 reshard_after_forward=strategy == "optim_grads_params", policy=torch_policy)
        self.module = module
        if init_model_with_meta_device:
            materialize_meta_module(module, self.device)
        if calculate_per_token_loss:
            for unit in self.units:
                unit.set_gradient_divide_factor(1.0)
                if hasattr(unit, "set_force_sum_reduction_for_comms"):
                    unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        for param in module.parameters():
            param.__fsdp_param__ = True
            param._megatron_fsdp_model = self
        self.is_param_fsdp_distributed = True

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module, first telling FSDP2 whether this microbatch's backward reduces gradients."""
        if torch.is_grad_enabled():
            self._prepare_gradient_sync()
        self.training_state = TrainingState.FORWARD
        try:
            return self.module(*inputs, **kwargs)
        finally:
            self.training_state = TrainingState.IDLE

    def _prepare_gradient_sync(self) -> None:
        reduce = self.model_auto_sync or self.is_last_microbatch
        if self.data_parallel_sharding_strategy in ("no_shard", "optim"):
            self.module.set_requires_gradient_sync(reduce)
            # Keep the gathered weights through the accumulation, as 0.19 keeps them whole.
            self.module.set_reshard_after_backward(reduce)
            self._unreduced_grads = not reduce
        elif self.dist_index.use_hybrid_fsdp:
            self.module.set_requires_all_reduce(reduce)
            self._unreduced_grads = not reduce
        self.microbatch_count = 0 if reduce and self.model_auto_sync else self.microbatch_count + 1

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without the final reduction (all but the last microbatch)."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    @contextmanager
    def sync(self) -> Iterator[None]:
        """Reduce gradients on every backward inside the block (``model_auto_sync`` on, then off)."""
        self.set_model_auto_sync(True)
        try:
            yield
        finally:
            self.set_model_auto_sync(False)

    def set_model_auto_sync(self, sync_model: bool = True) -> None:
        """Whether every backward reduces gradients completely (else only the last microbatch's does)."""
        self.model_auto_sync = sync_model

    def get_distributed_index(self) -> FSDPDistributedIndex:
        """The mesh dimensions and process groups this model is sharded over."""
        return self.dist_index

    @contextmanager
    def mixed_precision_context(self, mixed_precision_policy: MixedPrecisionPolicy) -> Iterator[None]:
        """Apply :meth:`reset_mixed_precision_policy` inside the block, restoring the policy after it."""
        backup = self.mp_policy
        self.reset_mixed_precision_policy(mixed_precision_policy)
        try:
            yield
        finally:
            self.mp_policy = backup

    def reset_mixed_precision_policy(self, mixed_precision_policy: MixedPrecisionPolicy) -> None:
        """Take a new policy; as in 0.19 the main dtypes stay, and so does ``grad_comm_dtype`` (no NCCL user
        buffers here, which is when 0.19 lets it change)."""
        self.mp_policy = MixedPrecisionPolicy(main_params_dtype=self.mp_policy.main_params_dtype,
                                              main_grads_dtype=self.mp_policy.main_grads_dtype,
                                              grad_comm_dtype=self.mp_policy.grad_comm_dtype)

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Nothing to start: FSDP2 all-gathers each unit's weights just before its forward."""

    def start_grad_sync(self, *unused: Any) -> None:
        """Nothing to start: FSDP2 reduces each unit's gradients during backward."""

    def synchronize_param_gather(self) -> None:
        """Nothing to wait for: FSDP2's all-gathers finish before the unit's forward runs."""

    def synchronize_gradient_reduce(self) -> None:
        """Check that the last backward reduced its gradients (FSDP2 waits for them before backward returns)."""
        if self._unreduced_grads:
            raise RuntimeError(
                "MegatronFSDP: the last backward accumulated gradients without reducing them "
                f"(sync_model_each_microbatch=False, strategy {self.data_parallel_sharding_strategy!r}"
                f"{', HSDP' if self.dist_index.use_hybrid_fsdp else ''}); run the last microbatch of the step "
                "after a no_sync() block, inside model.sync(), or after model.set_model_auto_sync(True)")

    def attach_grad_to_optimizer_state(self) -> None:
        """Nothing to attach: FSDP2 writes reduced gradients into the sharded parameters' ``.grad``."""

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """End the step's gradient synchronisation; call before ``optimizer.step()`` (see the class docstring)."""
        self.synchronize_gradient_reduce()
        if self.report_nan_in_param_grad:
            bad = [name for name, p in self.module.named_parameters()
                   if p.grad is not None and torch.isnan(_local(p.grad)).any()]
            if bad:
                raise RuntimeError(f"MegatronFSDP: NaN in the gradients of {bad[:10]} on rank {dist.get_rank()}")
        self.microbatch_count = 0

    def _replace_param_with_distributed_if_needed(self) -> None:
        """Kept for 0.19 callers: FSDP2's parameters are always the sharded DTensors between steps."""
        self.is_param_fsdp_distributed = True

    def _replace_param_with_raw_if_needed(self) -> None:
        """Kept for 0.19 callers: FSDP2 swaps in the gathered weights around each unit itself."""

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every (sharded) gradient by ``scaling_factor``."""
        with torch.no_grad():
            grads = [_local(p.grad) for p in self.module.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Drop the gradients; call at the start of each step, with ``optimizer.zero_grad()``."""
        for param in self.module.parameters():
            param.grad = None

    def install_optimized_model_weights(self) -> None:
        """Nothing to copy: the optimizer updates FSDP2's sharded parameters, which are the model's weights."""

    def broadcast_params(self) -> None:
        """Give every replica (HSDP's ``dp_outer`` or ``no_shard``'s ranks) the first replica's shards."""
        for param in self.module.parameters():
            if not isinstance(param, DTensor) or param.device_mesh.ndim < 2:
                continue
            group = param.device_mesh.get_group(0)
            with torch.no_grad():
                dist.broadcast(param._local_tensor, src=dist.get_global_rank(group, 0), group=group)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The same as :meth:`state_dict`."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor

