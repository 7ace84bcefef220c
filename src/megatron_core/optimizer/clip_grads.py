"""Gradient norm, clipping and zero counting across model-parallel ranks (Megatron-Core's ``clip_grads``).

Each rank sums ``|g|^p`` over the gradients it is responsible for, then the partial sums are
all-reduced over the grad-stats group (model parallel for the plain optimizers; for the
distributed optimizer data parallel then model parallel, a ``collectives.GroupProduct`` of the
model's own groups). The caller passes gradients already filtered so that every
element is counted once: see :func:`param_is_not_shared` and
:func:`param_is_not_tensor_parallel_duplicate`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_rank
from megatron_core.distributed import collectives
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.transformer.module import param_is_not_shared as param_is_not_shared


def param_is_not_tensor_parallel_duplicate(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """True for TP-sharded params, and for replicated params only on TP rank 0."""
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def counts_towards_grad_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether ``param``'s gradient counts towards the global norm and zero count on TP rank ``tp_rank``: not a
    tied duplicate, and not a TP-replicated copy off TP rank 0 (each element counted once)."""
    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, tp_rank)


def _stats_group(group: Any) -> Any:
    """As in Megatron-Core (torch's default): ``None`` is the WORLD group, or this process before init."""
    if group is None:
        return dist.group.WORLD if dist.is_initialized() else collectives.LOCAL
    return group


def _as_list(tensors: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _sharded_group_and_locals(tensors: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """``(group, local tensors)``: DTensors (FSDP2 shards) become their local shards, and ``group`` is
    the mesh group they are sharded over (``None`` when there is none); statistics must also be
    reduced over it. As Megatron-Core's ``get_data_parallel_group_if_dtensor``."""
    group = None
    out = []
    for t in tensors:
        if hasattr(t, "device_mesh") and hasattr(t, "to_local"):
            from megatron_core.distributed.torch_fully_sharded_data_parallel import fsdp_mesh_group

            mesh_group = fsdp_mesh_group(t)
            if group is not None and mesh_group != group:
                raise ValueError("gradients are sharded over different device meshes; cannot reduce their norm")
            group = mesh_group
            t = t._local_tensor
        out.append(t)
    return group, out


def get_grad_norm_fp32(grads_for_norm: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2,
                       grad_stats_parallel_group: Any = None) -> float:
    """The global ``norm_type``-norm of ``grads_for_norm`` summed over ``grad_stats_parallel_group`` (None: WORLD)."""
    norm_type = float(norm_type)
    if norm_type != math.inf:
        # The root is taken in double precision on the host, as it always was (runs stay bit-identical).
        return _sum_of_powers(grads_for_norm, norm_type, grad_stats_parallel_group).item() ** (1.0 / norm_type)
    grad_stats_parallel_group = _stats_group(grad_stats_parallel_group)
    sharded_group, grads = _sharded_group_and_locals(_as_list(grads_for_norm))
    device = grads[0].device if grads else torch.device("cpu")
    local = max((g.detach().abs().max().float() for g in grads if g.numel() > 0),
                default=torch.tensor(0.0, device=device))
    total = torch.tensor([float(local)], dtype=torch.float32, device=device)
    if sharded_group is not None:
        collectives.all_reduce(total, sharded_group, op="max")
    collectives.all_reduce(total, grad_stats_parallel_group, op="max")
    return total.item()


def grad_norm_tensor(grads_for_norm: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2,
                     grad_stats_parallel_group: Any = None) -> torch.Tensor:
    """:func:`get_grad_norm_fp32` (finite ``norm_type``) as a 1-element fp32 tensor on the gradients' device.

    Nothing waits for the device: callers that only feed the norm to further kernels avoid a host sync.
    """
    return _sum_of_powers(grads_for_norm, norm_type, grad_stats_parallel_group).pow(1.0 / norm_type)


_ONE_KERNEL_NORM_NUMEL = 1 << 24


def _coalesce_adjacent(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` with runs of 1-D contiguous views that abut in one storage (a DDP buffer's bucket shards)
    merged into one view each: the same elements, read by fewer, larger kernels."""
    flat: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    for t in tensors:
        (flat if t.dim() == 1 and t.is_contiguous() and t.numel() > 0 else rest).append(t)
    flat.sort(key=lambda t: (t.untyped_storage().data_ptr(), t.dtype.itemsize, t.storage_offset()))
    out: list[torch.Tensor] = []
    for t in flat:
        last = out[-1] if out else None
        if (last is not None and last.dtype == t.dtype and last.device == t.device
                and last.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                and last.storage_offset() + last.numel() == t.storage_offset()):
            out[-1] = last.as_strided((last.numel() + t.numel(),), (1,), last.storage_offset())
        else:
            out.append(t)
    return out + rest


def _norm_dtype(grad: torch.Tensor) -> torch.dtype:
    """The dtype a gradient's norm accumulates in: fp32, or fp64 for fp64 gradients."""
    return torch.float64 if grad.dtype == torch.float64 else torch.float32


def _sum_of_powers(grads_for_norm: Iterable[torch.Tensor] | torch.Tensor, norm_type: float,
                   grad_stats_parallel_group: Any) -> torch.Tensor:
    """``sum |g|^p`` over the gradients and the group, as a 1-element fp32 tensor."""
    grad_stats_parallel_group = _stats_group(grad_stats_parallel_group)
    sharded_group, grads = _sharded_group_and_locals(_as_list(grads_for_norm))
    device = grads[0].device if grads else torch.device("cpu")
    if grads:
        large, small = [], []
        for g in _coalesce_adjacent([g.detach() for g in grads]):
            (large if g.numel() >= _ONE_KERNEL_NORM_NUMEL else small).append(g)
        # One reduction kernel over a large flat tensor runs near the copy bandwidth; the multi-tensor kernel
        # serves many small tensors in few launches but reads a large one at about three quarters of it. Both
        # accumulate in fp32 whatever the gradients' dtype, reading bf16 gradients as they are (an fp32 copy
        # first would write and read 6 more bytes per element).
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=_norm_dtype(g)).float() for g in large]
        for dtype in dict.fromkeys(_norm_dtype(g) for g in small):  # first-seen order: the same sum every run
            norms += [n.float() for n in torch._foreach_norm([g for g in small if _norm_dtype(g) == dtype], norm_type,
                                                             dtype=dtype)]
        local = torch.stack(norms).pow(norm_type).sum().reshape(1)
    else:
        local = torch.zeros(1, dtype=torch.float32, device=device)
    total = local.to(torch.float32)
    if sharded_group is not None:
        collectives.all_reduce(total, sharded_group)
    collectives.all_reduce(total, grad_stats_parallel_group)
    return total


def clip_grad_by_total_norm_fp32(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                                 total_norm: float, use_decoupled_grad: bool = False) -> None:
    """Scale the gradients of ``parameters`` by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    params = _as_list(parameters)
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    _, grads = _sharded_group_and_locals([getattr(p, attr) for p in params if getattr(p, attr) is not None])
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def count_zeros_fp32(parameters: Iterable[torch.Tensor] | torch.Tensor, grad_stats_parallel_group: Any,
                     use_decoupled_grad: bool = False, tp_group: Any = None) -> float:
    """Number of zero gradient elements over ``grad_stats_parallel_group``, each element counted once.

    ``tp_group`` (default: the resolved TP group) decides which rank counts TP-replicated params
    (its rank 0); ``grad_stats_parallel_group`` None is WORLD.
    """
    grad_stats_parallel_group = _stats_group(grad_stats_parallel_group)
    params = _as_list(parameters)
    tp_rank = get_pg_rank(collectives.local_if_none(resolve_process_group("tp", group=tp_group)))
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    device = next((getattr(p, attr).device for p in params if getattr(p, attr) is not None), torch.device("cpu"))
    total = torch.zeros(1, dtype=torch.float32, device=device)
    sharded_group = None
    for p in params:
        grad = getattr(p, attr)
        if grad is not None and counts_towards_grad_norm(p, tp_rank):
            group, (grad,) = _sharded_group_and_locals([grad])
            sharded_group = group or sharded_group
            total += grad.numel() - torch.count_nonzero(grad)
    if sharded_group is not None:
        collectives.all_reduce(total, sharded_group)
    collectives.all_reduce(total, grad_stats_parallel_group)
    return total.item()
