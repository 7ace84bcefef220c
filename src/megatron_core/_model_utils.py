"""Model and batch helpers that training loops import from ``megatron_core.utils`` (re-exported there).

``unwrap_model`` lives on the ground floor (``_ground.wrappers``); it is re-exported here for older imports.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

from megatron_core import device

logger = logging.getLogger(__name__)


def _param_hash(param: torch.Tensor) -> torch.Tensor:
    data = param.detach().to("cpu", torch.float32).contiguous().numpy()
    return torch.frombuffer(bytearray(hashlib.sha1(data.tobytes()).digest()), dtype=torch.uint8)


def check_param_hashes_across_dp_replicas(model: list[torch.nn.Module], cross_check: bool = False) -> bool:
    """True when every parameter's SHA-1 equals data-parallel rank 0's (all replicas' with ``cross_check``).

    Expert parameters (``param.allreduce is False``) are compared over the expert data-parallel group,
    the rest over the data-parallel group; mismatching parameter names are logged.
    """
    from megatron_core import parallel_state

    dense: list[tuple[int, str, torch.Tensor]] = []
    expert: list[tuple[int, str, torch.Tensor]] = []
    for chunk_id, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            (dense if getattr(param, "allreduce", True) else expert).append((chunk_id, name, _param_hash(param)))
    all_match = True
    for entries, group in ((dense, parallel_state.get_data_parallel_group()),
                           (expert, parallel_state.get_expert_data_parallel_group(check_initialized=False))):
        if not entries:
            continue
        local = torch.stack([h for _, _, h in entries]).to(device.get_current_device())
        size = torch.distributed.get_world_size(group) if group is not None else 1
        gathered = [torch.zeros_like(local) for _ in range(size)]
        if group is not None:
            torch.distributed.all_gather(gathered, local, group=group)
        else:
            gathered = [local]
        match = torch.equal(local, gathered[0])
        if not match:
            for i, (chunk_id, name, _) in enumerate(entries):
                if not torch.equal(local[i], gathered[0][i]):
                    logger.info("[Rank %d] hash of %s in model chunk %d differs from DP rank 0",
                                torch.distributed.get_rank(), name, chunk_id)
        if cross_check:
            match = all(torch.equal(local, other) for other in gathered)
        all_match &= match
    return all_match


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        return None
    return DTensor


def to_local_if_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a ``DTensor``; any other tensor unchanged."""
    dtensor = _dtensor_type()
    with torch.no_grad():
        return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor


def get_full_tensor_if_necessary(tensor: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard, or its full (replicated) value when some mesh dimension shards a tensor
    dimension over more ranks than it has elements (a rank would hold an empty shard). Collective then."""
    from torch.distributed.tensor.placement_types import Shard

    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard) and tensor.device_mesh.shape[mesh_dim] > tensor.shape[placement.dim]:
            return tensor.full_tensor()
    return tensor._local_tensor


def get_data_parallel_group_if_dtensor(tensor: torch.Tensor, data_parallel_group: Any = None) -> Any:
    """The process group of a 1-D ``DTensor``'s mesh (checked against ``data_parallel_group``); else None."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        group = tensor.device_mesh.get_group()
        if data_parallel_group is not None and group != data_parallel_group:
            raise ValueError("get_data_parallel_group_if_dtensor: the DTensor's mesh group is not data_parallel_group")
        return group
    return None


def local_multi_tensor_applier(op: Any, noop_flag_buffer: Any, tensor_lists: Any, *args: Any) -> Any:
    """Call a multi-tensor ``op`` the way apex's ``multi_tensor_applier`` does (chunk size 65536)."""
    return op(2048 * 32, noop_flag_buffer, tensor_lists, *args)


def local_multi_tensor_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]],
                               per_tensor: bool, *args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """L2 norm over every tensor in ``tensor_lists`` (drop-in for ``amp_C.multi_tensor_l2norm``).

    Returns ``(norm, per_tensor_norms)``: a 1-element fp32 tensor on the tensors' device, and the
    per-tensor norms of the first list when ``per_tensor`` (else None).
    """
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=device.get_current_device()), None
    norms = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])
    total = torch.linalg.vector_norm(norms).reshape(1)
    per = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensor_lists[0]]) if per_tensor else None
    return total, per


def local_multi_tensor_scale(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]],
                             scale: float) -> None:
    """``dst.copy_(src * scale)`` for each pair of ``tensor_lists[0]``, ``tensor_lists[1]``."""
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        dst.copy_(src * scale)
