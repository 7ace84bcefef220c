"""``TorchFullyShardedDataParallel``: fully sharded data parallelism through PyTorch FSDP2 (``fully_shard``).

Megatron-Core's wrapper of the same name. Every ``TransformerLayer`` (and the embedding) becomes
its own FSDP unit, then the root module: parameters, gradients and optimizer state are sharded
along dim 0 over the data parallel (x context parallel) group, parameters are all-gathered just
before each unit's forward and backward and gradients reduce-scattered after its backward.
The sharding runtime is PyTorch's; this class builds the ``DeviceMesh`` from the library's
process groups, picks the mixed-precision policy and keeps the DDP-wrapper interface
(``no_sync``, ``finish_grad_sync``, ``zero_grad_buffer``, ``scale_gradients``, ``sharded_state_dict``)
that the schedules, ``finalize_model_grads``, the optimizer factory and checkpointing use.

Tensor parallelism composes: each rank shards its TP-local tensors over the DP group; with TP > 1
the mesh is the 2-D ``(dp, tp)`` mesh built from both groups and the parameters live on its
``dp`` dimension (TP itself stays the library's own layers). Layouts FSDP cannot serve raise a
``ValueError`` naming the setting: pipeline or expert parallelism, tied input/output embeddings,
fp16, gradient-accumulation fusion, Megatron's distributed optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from megatron_core._ground import fsdp_unit_types, get_pg_size, module_chain, unwrap_model
from megatron_core.device import get_current_device
from megatron_core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_core.distributed.fp8_params import is_fp8_param
from megatron_core.distributed.torch_fully_sharded_data_parallel_checkpoint import (
    fsdp_sharded_state_dict,
    is_fsdp_dtensor,
    local_row_range,
)
from megatron_core.process_groups_config import resolve_process_group

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    HAVE_FSDP = True
except ImportError:  # pragma: no cover - torch < 2.4
    HAVE_FSDP = False

__all__ = ["TorchFullyShardedDataParallel", "fsdp_mesh_group", "is_torch_fsdp_module"]


def _validate(config: Any, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
              pg_collection: Any) -> None:
    """Reject the layouts FSDP2 cannot serve, naming the setting."""
    if any(getattr(p, "skip_backward_post_hook", False) for p in module.parameters()):
        raise ValueError("delay_wgrad_compute / overlap_dispatch_backward_with_experts_wgrad (weight gradients "
                         "deferred to backward_dw) cannot be combined with TorchFullyShardedDataParallel, whose "
                         "reduce-scatter would run before them; use DistributedDataParallel")
    if ddp_config.use_distributed_optimizer:
        raise ValueError("use_distributed_optimizer=True cannot be combined with TorchFullyShardedDataParallel "
                         "(FSDP2 shards the optimizer state itself)")
    pp_size = max(get_pg_size(resolve_process_group("pp", pg_collection)),
                  getattr(config, "pipeline_model_parallel_size", 1) or 1)
    if pp_size > 1:
        raise ValueError(f"TorchFullyShardedDataParallel does not support pipeline parallelism "
                         f"(pipeline_model_parallel_size={pp_size}); use DistributedDataParallel")
    ep_size = max(get_pg_size(resolve_process_group("ep", pg_collection)),
                  getattr(config, "expert_model_parallel_size", 1) or 1)
    if ep_size > 1 or any(not getattr(p, "allreduce", True) for p in module.parameters()):
        raise ValueError(f"TorchFullyShardedDataParallel does not support expert parallel parameters "
                         f"(expert_model_parallel_size={ep_size}); use DistributedDataParallel")
    if getattr(config, "fp8_param", False) or any(is_fp8_param(p) for p in module.parameters()):
        raise ValueError("fp8_param=True (FP8 parameters) is not supported with TorchFullyShardedDataParallel; use "
                         "DistributedDataParallel with use_distributed_optimizer=True and fp8_param_gather=True")
    if getattr(config, "fp16", False):
        raise ValueError("TorchFullyShardedDataParallel does not support fp16=True (use bf16)")
    if getattr(config, "gradient_accumulation_fusion", False):
        raise ValueError("TorchFullyShardedDataParallel does not support gradient_accumulation_fusion=True")
    inner = unwrap_model(module)
    if getattr(inner, "share_embeddings_and_output_weights", False):
        raise ValueError("TorchFullyShardedDataParallel needs share_embeddings_and_output_weights=False "
                         "(a tied input/output embedding cannot live in two FSDP units)")


_MESH_GROUPS: dict[tuple[int, ...], Any] = {}
_MESH_COUNT = 0


def fsdp_mesh_group(tensor: Any) -> Any:
    """The live process group a DTensor (FSDP shard or gradient) is sharded over.

    Looked up by the mesh's ranks among the groups of the wrappers built in this process (the latest
    wins): DTensor's sharding-propagation cache may hand out an equal mesh object from an earlier,
    since destroyed, set of process groups (re-initialisation in tests or notebooks).
    """
    mesh = tensor.device_mesh
    key = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    group = _MESH_GROUPS.get(key)
    return group if group is not None else mesh.get_group()


def _build_mesh(dp_group: Any, tp_group: Any, device_type: str) -> tuple[Any, Any]:
    """``(mesh, dp_mesh)``: 1-D over the DP group, or 2-D ``(dp, tp)`` from both groups when TP > 1.

    Dimension names carry a per-process counter: torch treats meshes with equal ranks and names as
    the same mesh (caches), which would resurrect destroyed process groups after re-initialisation.
    """
    global _MESH_COUNT
    _MESH_COUNT += 1
    dp_name, tp_name = f"dp{_MESH_COUNT}", f"tp{_MESH_COUNT}"
    if get_pg_size(tp_group) <= 1:
        mesh = DeviceMesh.from_group(dp_group, device_type, mesh_dim_names=(dp_name,))
        return mesh, mesh
    tp_ranks = dist.get_process_group_ranks(tp_group)
    rows: list[Any] = [None] * get_pg_size(dp_group)
    dist.all_gather_object(rows, tp_ranks, group=dp_group)
    grid = torch.tensor(rows, dtype=torch.int)
    mesh = DeviceMesh.from_group([dp_group, tp_group], device_type, mesh=grid, mesh_dim_names=(dp_name, tp_name))
    return mesh, mesh[dp_name]


class TorchFullyShardedDataParallel(torch.nn.Module):
    """Shard ``module`` with PyTorch FSDP2 over the data parallel group (see the module docstring).

    ``sub_modules_to_wrap``: module classes that become their own FSDP unit (default: the
    classes registered with ``_ground.register_fsdp_unit``: ``TransformerLayer`` and ``LanguageModelEmbedding``); a module's ``_fsdp_modules`` attribute
    adds more. ``process_group``: the group to shard over (default: DP x CP from ``pg_collection``
    or ``parallel_state``). With ``config.bf16`` the sharded parameters stay fp32 (they are the
    optimizer's main parameters), compute runs in bf16 and gradients are reduced in fp32.
    """

    def __init__(self, config: Any, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                 sub_modules_to_wrap: Iterable[type] | None = None, disable_bucketing: bool = False,
                 process_group: dist.ProcessGroup | None = None, pg_collection: Any = None) -> None:
        if not HAVE_FSDP:
            raise ImportError("TorchFullyShardedDataParallel needs PyTorch >= 2.4 (torch.distributed.fsdp.fully_shard)")
        super().__init__()
        _validate(config, ddp_config, module, pg_collection)
        self.config = config
        self.ddp_config = ddp_config
        self.module = module
        self.process_group = process_group or resolve_process_group("dp_cp", pg_collection)
        if self.process_group is None:
            raise RuntimeError("TorchFullyShardedDataParallel needs torch.distributed and a data parallel group "
                               "(initialize_model_parallel, pg_collection or process_group)")
        self.tp_group = resolve_process_group("tp", pg_collection)
        device_type = get_current_device().type
        self.device_mesh, self.dp_mesh = _build_mesh(self.process_group, self.tp_group, device_type)
        _MESH_GROUPS[tuple(int(r) for r in self.dp_mesh.mesh.flatten().tolist())] = self.process_group

        for param in module.parameters():
            if param.is_floating_point() and param.dtype != torch.float32:
                # FSDP2's sharded parameters are the fp32 main weights; compute dtype comes from the policy.
                module.to(torch.float32)
                break
        compute_dtype = torch.bfloat16 if getattr(config, "bf16", False) else None
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype,
                                      reduce_dtype=torch.float32 if compute_dtype is not None else None)
        kwargs = {"mesh": self.dp_mesh, "reshard_after_forward": getattr(ddp_config, "reshard_after_forward", True),
                  "mp_policy": policy}

        attrs = {name: dict(vars(param)) for name, param in module.named_parameters()}
        wrap_types = set(sub_modules_to_wrap) if sub_modules_to_wrap is not None else set(fsdp_unit_types())
        for sub_module in module.modules():
            wrap_types.update(getattr(sub_module, "_fsdp_modules", []))
        self.fsdp_units: list[torch.nn.Module] = []
        for sub_module in module.modules():
            if sub_module is not module and isinstance(sub_module, tuple(wrap_types)):
                fully_shard(sub_module, **kwargs)
                if getattr(config, "recompute_granularity", None) is not None:
                    # Recompute re-runs forwards inside backward: fix the prefetch order explicitly.
                    sub_module.set_modules_to_backward_prefetch(self.fsdp_units[-1:])
                self.fsdp_units.append(sub_module)
        fully_shard(module, **kwargs)
        self.fsdp_units.append(module)
        for name, param in module.named_parameters():
            for key, value in attrs.get(name, {}).items():
                setattr(param, key, value)
            param.is_torch_fsdp2_param = True
        if getattr(config, "calculate_per_token_loss", False):
            for unit in self.fsdp_units:
                unit.set_gradient_divide_factor(1.0)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Call the wrapped (sharded) module."""
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded gradients without reduce-scattering them (all but the last microbatch)."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def start_grad_sync(self, *unused: Any) -> None:
        """Nothing to start: FSDP2 reduce-scatters each unit's gradients during backward."""

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Nothing to wait for: FSDP2's backward ends once every reduce-scatter is done."""

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Nothing to do: FSDP2 all-gathers parameters before each unit's forward."""

    def zero_grad_buffer(self) -> None:
        """Drop every (sharded) gradient; call before each iteration."""
        for param in self.module.parameters():
            param.grad = None

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every sharded gradient by ``scaling_factor``."""
        with torch.no_grad():
            grads = [_local(p.grad) for p in self.module.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scaling_factor)

    def broadcast_params(self) -> None:
        """Nothing to do: each rank holds only its own shard, cut from identically initialised weights."""

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict (DTensor values; FSDP adds no keys)."""
        return self.module.state_dict(*args, **kwargs)

    def sharded_state_dict(self, prefix: str = "", *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The module's sharded state dict with every DTensor replaced by this rank's rows (``dist_checkpointing``)."""
        return fsdp_sharded_state_dict(self.module.sharded_state_dict(prefix, *args, **kwargs))

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load this rank's rows (from :meth:`sharded_state_dict` via ``dist_checkpointing``) or full tensors."""
        params = dict(self.module.named_parameters())
        plain = {}
        missing = []
        for name, param in params.items():
            if not is_fsdp_dtensor(param):
                continue
            if name not in state_dict:
                if param.to_local().numel():
                    missing.append(name)
                continue
            value = state_dict[name]
            local = param._local_tensor
            if is_fsdp_dtensor(value):
                value = value.to_local()
            elif tuple(value.shape) == tuple(param.shape) and tuple(value.shape) != tuple(local.shape):
                start, end = local_row_range(param)
                value = value[start:end]
            with torch.no_grad():
                local.copy_(value.reshape(local.shape))
        for name, value in state_dict.items():
            if name not in params or not is_fsdp_dtensor(params[name]):
                plain[name] = value
        if strict and missing:
            raise RuntimeError(f"missing keys in state dict for TorchFullyShardedDataParallel: {missing[:10]}")
        if plain:
            for name, buf in self.module.named_buffers():
                if name in plain:
                    with torch.no_grad():
                        buf.copy_(plain.pop(name))
        if strict and plain:
            unknown = [k for k in plain if not k.endswith("_extra_state")]
            if unknown:
                raise RuntimeError(f"unexpected keys in state dict for TorchFullyShardedDataParallel: {unknown[:10]}")
        return None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if is_fsdp_dtensor(tensor) else tensor


def is_torch_fsdp_module(module: Any) -> bool:
    """True for a :class:`TorchFullyShardedDataParallel` wrapper (possibly inside another wrapper)."""
    return any(isinstance(m, TorchFullyShardedDataParallel) for m in module_chain(module))


