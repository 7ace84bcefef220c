"""Pipeline-parallel point-to-point and broadcast helpers for inference (Megatron-Core's ``inference.communication_utils``).

Inference runs the same schedule on every rank, so each stage knows the shape of what it
receives: ``[tokens, 1, hidden]`` activations forward, and the logits of the last stage
broadcast back to every stage (each then samples identically from the same seeded generator).
All collectives of the inference package live here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "pipeline_group",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "send_to_next_pipeline_rank",
    "recv_from_prev_pipeline_rank",
    "broadcast_from_last_pipeline_stage",
]


def pipeline_group(model: Any) -> Any:
    """The model's pipeline group (``pg_collection.pp``, else ``parallel_state``'s), or ``None`` for PP = 1."""
    from megatron_core import parallel_state

    group = getattr(getattr(model, "pg_collection", None), "pp", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_pipeline_model_parallel_group()
    if group is None or dist.get_world_size(group) == 1:
        return None
    return group


def _ranks(group: Any) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def is_pipeline_first_stage(group: Any) -> bool:
    """Whether this rank is stage 0 of ``group`` (always for ``None``)."""
    return group is None or _ranks(group)[0] == 0


def is_pipeline_last_stage(group: Any) -> bool:
    """Whether this rank is the last stage of ``group`` (always for ``None``)."""
    if group is None:
        return True
    rank, size = _ranks(group)
    return rank == size - 1


def send_to_next_pipeline_rank(tensor: torch.Tensor, group: Any) -> None:
    """Send activations to the next stage."""
    rank, _ = _ranks(group)
    dist.send(tensor.contiguous(), dist.get_global_rank(group, rank + 1), group=group)


def recv_from_prev_pipeline_rank(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group: Any) -> torch.Tensor:
    """Receive activations of ``shape`` from the previous stage."""
    rank, _ = _ranks(group)
    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buffer, dist.get_global_rank(group, rank - 1), group=group)
    return buffer


def broadcast_from_last_pipeline_stage(
    tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group: Any
) -> torch.Tensor:
    """The last stage's ``tensor`` on every stage of ``group``."""
    _, size = _ranks(group)
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype, device=device)
    else:
        tensor = tensor.contiguous()
    dist.broadcast(tensor, dist.get_global_rank(group, size - 1), group=group)
    return tensor
