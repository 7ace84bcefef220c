"""Pipeline-parallel point-to-point and broadcast helpers for inference (Megatron-Core's ``inference.communication_utils``).

Inference runs the same schedule on every rank, so each stage knows the shape of what it
receives: ``[tokens, 1, hidden]`` activations forward, and the logits of the last stage
broadcast back to every stage (each then samples identically from the same seeded generator).
``pp_group=None`` means ``parallel_state``'s pipeline group (or a single stage when it is not
initialized). ``broadcast_tensor`` / ``broadcast_*_list`` send a value from one global rank to
all ranks, or (``data_parallel=True``) from the first rank of this model-parallel group to the
rest of it. Buffers a rank allocates to receive into live on
:func:`megatron_core.device.get_current_device`. All collectives of the inference package live here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.device import get_current_device

__all__ = [
    "broadcast_float_list",
    "broadcast_from_last_pipeline_stage",
    "broadcast_int_list",
    "broadcast_list",
    "broadcast_tensor",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "pipeline_group",
    "recv_from_prev_pipeline_rank",
    "recv_from_prev_pipeline_rank_",
    "send_to_next_pipeline_rank",
]


def pipeline_group(model: Any) -> Any:
    """The model's pipeline group (``pg_collection.pp``, else ``parallel_state``'s), or ``None`` for PP = 1."""
    group = getattr(getattr(model, "pg_collection", None), "pp", None)
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_pipeline_model_parallel_group()
    if group is None or dist.get_world_size(group) == 1:
        return None
    return group


def _registered_pp_group() -> Any:
    """``parallel_state``'s pipeline group, or ``None`` when model parallelism is not initialized."""
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_pipeline_model_parallel_group()
    return None


def is_pipeline_first_stage(pp_group: Any) -> bool:
    """Whether this rank is stage 0 of ``pp_group`` (``None``: of ``parallel_state``'s pipeline; one stage: True)."""
    pp_group = pp_group if pp_group is not None else _registered_pp_group()
    return pp_group is None or dist.get_rank(pp_group) == 0


def is_pipeline_last_stage(pp_group: Any) -> bool:
    """Whether this rank is the last stage of ``pp_group`` (``None`` as in :func:`is_pipeline_first_stage`)."""
    pp_group = pp_group if pp_group is not None else _registered_pp_group()
    return pp_group is None or dist.get_rank(pp_group) == dist.get_world_size(pp_group) - 1


def _neighbour(pp_group: Any, step: int) -> tuple[Any, int]:
    """``(group, global rank)`` of the stage ``step`` positions away in the ring of ``pp_group``."""
    pp_group = pp_group if pp_group is not None else _registered_pp_group()
    if pp_group is None:
        raise ValueError("pipeline send/recv needs pp_group or an initialized parallel_state pipeline group")
    ranks = dist.get_process_group_ranks(pp_group)
    return pp_group, ranks[(dist.get_rank(pp_group) + step) % len(ranks)]


def send_to_next_pipeline_rank(tensor: torch.Tensor | None = None, pp_group: Any = None) -> None:
    """Send ``tensor`` (the activations) to the next stage of ``pp_group``; blocks until it is sent."""
    group, dst = _neighbour(pp_group, +1)
    dist.send(tensor.contiguous(), dst, group=group)


def recv_from_prev_pipeline_rank_(recv_buffer: torch.Tensor | None = None, pp_group: Any = None) -> None:
    """Receive the previous stage's activations into ``recv_buffer`` (in place; its shape and dtype must match)."""
    if recv_buffer is None:
        raise ValueError("recv_from_prev_pipeline_rank_ needs recv_buffer, the tensor to receive into")
    group, src = _neighbour(pp_group, -1)
    dist.recv(recv_buffer, src, group=group)


def recv_from_prev_pipeline_rank(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                                 pp_group: Any) -> torch.Tensor:
    """A new tensor of ``shape`` / ``dtype`` on ``device`` holding the previous stage's activations."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    recv_from_prev_pipeline_rank_(buffer, pp_group)
    return buffer


def _check_tensor(tensor: torch.Tensor | None, size: Sequence[int], dtype: torch.dtype, what: str) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"{what}: the source rank must pass the tensor to broadcast")
    if list(tensor.shape) != list(size) or tensor.dtype != dtype:
        raise ValueError(f"{what}: the tensor has shape {list(tensor.shape)} and dtype {tensor.dtype}, the "
                         f"receivers expect size {list(size)} and dtype {dtype}")
    return tensor.contiguous()


def broadcast_from_last_pipeline_stage(size: Sequence[int], dtype: torch.dtype, tensor: torch.Tensor | None = None,
                                       pp_group: Any = None, *, device: torch.device | None = None) -> torch.Tensor:
    """The last stage's ``tensor`` (of ``size`` and ``dtype``) on every stage of ``pp_group``.

    The other stages receive into a new tensor on ``device`` (default: the current device).
    """
    pp_group = pp_group if pp_group is not None else _registered_pp_group()
    if is_pipeline_last_stage(pp_group):
        tensor = _check_tensor(tensor, size, dtype, "broadcast_from_last_pipeline_stage")
    else:
        tensor = torch.empty(tuple(size), dtype=dtype, device=device or get_current_device())
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.broadcast(tensor, dist.get_process_group_ranks(pp_group)[-1], group=pp_group)
    return tensor


def broadcast_tensor(size: Sequence[int], dtype: torch.dtype, tensor: torch.Tensor | None = None, rank: int = 0,
                     data_parallel: bool = False) -> torch.Tensor:
    """Global rank ``rank``'s ``tensor`` on every rank (``size`` and ``dtype`` known everywhere).

    ``data_parallel=True``: within this rank's model-parallel group only, from its first rank (``rank`` is
    ignored), so each data-parallel replica broadcasts its own value.
    """
    group = None
    if data_parallel:
        rank = parallel_state.get_model_parallel_src_rank()
        group = parallel_state.get_model_parallel_group()
    if dist.get_rank() == rank:
        tensor = _check_tensor(tensor, size, dtype, "broadcast_tensor")
    else:
        tensor = torch.empty(tuple(size), dtype=dtype, device=get_current_device())
    dist.broadcast(tensor, rank, group=group)
    return tensor


def broadcast_list(size: Sequence[int] | int, dtype: torch.dtype, list_values: Sequence[Any] | None = None,
                   rank: int = 0, data_parallel: bool = False) -> torch.Tensor:
    """:func:`broadcast_tensor` of ``list_values`` (given on the source rank only) as a ``dtype`` tensor."""
    size = [size] if isinstance(size, int) else list(size)
    src = parallel_state.get_model_parallel_src_rank() if data_parallel else rank
    tensor = None
    if dist.get_rank() == src:
        tensor = torch.tensor(list_values, dtype=dtype, device=get_current_device())
    return broadcast_tensor(size, dtype, tensor=tensor, rank=src, data_parallel=data_parallel)


def broadcast_int_list(size: Sequence[int] | int, int_list: Sequence[int] | None = None, rank: int = 0,
                       data_parallel: bool = False) -> torch.Tensor:
    """:func:`broadcast_list` of integers (``int64``)."""
    return broadcast_list(size, torch.int64, list_values=int_list, rank=rank, data_parallel=data_parallel)


def broadcast_float_list(size: Sequence[int] | int, float_list: Sequence[float] | None = None, rank: int = 0,
                         data_parallel: bool = False) -> torch.Tensor:
    """:func:`broadcast_list` of floats (``float32``)."""
    return broadcast_list(size, torch.float32, list_values=float_list, rank=rank, data_parallel=data_parallel)
