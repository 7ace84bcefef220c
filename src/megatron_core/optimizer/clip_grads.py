"""Gradient norm, clipping and zero counting across model-parallel ranks (Megatron-Core's ``clip_grads``).

Each rank sums ``|g|^p`` over the gradients it is responsible for, then the partial sums are
all-reduced over the grad-stats group (model parallel for the plain optimizers, the whole world
for the distributed optimizer). The caller passes gradients already filtered so that every
element is counted once: see :func:`param_is_not_shared` and
:func:`param_is_not_tensor_parallel_duplicate`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from megatron_core.distributed import collectives
from megatron_core.process_groups_config import resolve_process_group


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """False for the duplicate of a tied weight (``param.shared``), counted on the stage that owns it."""
    return not getattr(param, "shared", False)


def param_is_not_tensor_parallel_duplicate(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """True for TP-sharded params, and for replicated params only on TP rank 0."""
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def _stats_group(group: Any) -> Any:
    """As in Megatron-Core (torch's default): ``None`` is the WORLD group, or this process before init."""
    if group is None:
        return dist.group.WORLD if dist.is_initialized() else collectives.LOCAL
    return group


def _as_list(tensors: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def get_grad_norm_fp32(grads_for_norm: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2,
                       grad_stats_parallel_group: Any = None) -> float:
    """The global ``norm_type``-norm of ``grads_for_norm`` summed over ``grad_stats_parallel_group`` (None: WORLD)."""
    norm_type = float(norm_type)
    if norm_type != math.inf:
        return grad_norm_tensor(grads_for_norm, norm_type, grad_stats_parallel_group).item()
    grad_stats_parallel_group = _stats_group(grad_stats_parallel_group)
    grads = _as_list(grads_for_norm)
    device = grads[0].device if grads else torch.device("cpu")
    local = max((g.detach().abs().max().float() for g in grads if g.numel() > 0),
                default=torch.tensor(0.0, device=device))
    total = torch.tensor([float(local)], dtype=torch.float32, device=device)
    collectives.all_reduce(total, grad_stats_parallel_group, op="max")
    return total.item()


def grad_norm_tensor(grads_for_norm: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2,
                     grad_stats_parallel_group: Any = None) -> torch.Tensor:
    """:func:`get_grad_norm_fp32` (finite ``norm_type``) as a 1-element fp32 tensor on the gradients' device.

    Nothing waits for the device: callers that only feed the norm to further kernels avoid a host sync.
    """
    grad_stats_parallel_group = _stats_group(grad_stats_parallel_group)
    grads = _as_list(grads_for_norm)
    device = grads[0].device if grads else torch.device("cpu")
    if grads:
        norms = torch._foreach_norm([g.detach().float() for g in grads], norm_type)
        local = torch.stack(norms).pow(norm_type).sum().reshape(1)
    else:
        local = torch.zeros(1, dtype=torch.float32, device=device)
    total = local.to(torch.float32)
    collectives.all_reduce(total, grad_stats_parallel_group)
    return total.pow(1.0 / norm_type)


def clip_grad_by_total_norm_fp32(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                                 total_norm: float, use_decoupled_grad: bool = False) -> None:
    """Scale the gradients of ``parameters`` by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    params = _as_list(parameters)
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in params if getattr(p, attr) is not None]
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
    tp_rank = collectives.group_rank(collectives.local_if_none(resolve_process_group("tp", group=tp_group)))
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    device = next((getattr(p, attr).device for p in params if getattr(p, attr) is not None), torch.device("cpu"))
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for p in params:
        grad = getattr(p, attr)
        if grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, tp_rank):
            total += grad.numel() - torch.count_nonzero(grad)
    collectives.all_reduce(total, grad_stats_parallel_group)
    return total.item()
