"""Sharded state dicts of FSDP2-sharded modules: DTensor parameters become ``ShardedTensor`` pieces.

A module wrapped in :class:`~megatron_core.distributed.TorchFullyShardedDataParallel` describes its
tensors as usual (``sharded_state_dict``: TP sharding, stacked layer axis, SwiGLU factories), but
each parameter is then a ``DTensor`` whose local tensor is a block of rows of the TP-local tensor:
PyTorch's ``fully_shard`` cuts dim 0 with ``torch.chunk`` semantics (rank ``r`` holds rows
``[r * c, min((r + 1) * c, n))`` with ``c = ceil(n / dp)``; trailing ranks may hold fewer or none).

:func:`fsdp_sharded_state_dict` rewrites such entries in place: the data becomes the local rows,
the global offset along dim 0 moves by the first row, and the data-parallel replica id becomes 0
(every DP rank writes its own rows, as in Megatron-Core). Factories (a SwiGLU ``linear_fc1``
stored as separate gate and up tensors) are rebuilt so that each DP rank writes the intersection
of its rows with every chunk. The global keys, shapes and offsets are those of an unsharded model,
so checkpoints move freely between FSDP, DDP and the distributed optimizer at any DP size.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

try:  # DTensor ships with torch >= 2.4; the FSDP wrapper needs it anyway.
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor, Shard = None, None


def is_fsdp_dtensor(tensor: Any) -> bool:
    """True for a DTensor sharded along dim 0 on a 1-D mesh (what ``fully_shard`` makes of a parameter)."""
    return (DTensor is not None and isinstance(tensor, DTensor) and len(tensor.placements) == 1
            and isinstance(tensor.placements[0], Shard) and tensor.placements[0].dim == 0)


def local_row_range(tensor: DTensor) -> tuple[int, int]:
    """``[start, end)`` rows of dim 0 that this rank's local tensor holds (``torch.chunk`` layout)."""
    rows = tensor.shape[0]
    mesh = tensor.device_mesh
    size, rank = mesh.size(), mesh.get_local_rank()
    chunk = -(-rows // size) if rows else 0
    start = min(rank * chunk, rows)
    end = min(start + chunk, rows)
    local_rows = tensor.to_local().shape[0] if tensor.dim() else 0
    if end - start != local_rows:
        raise CheckpointingException(
            f"FSDP shard of a {tuple(tensor.shape)} tensor on rank {rank} of {size} holds {local_rows} rows, "
            f"expected rows [{start}, {end})"
        )
    return start, end


def _dp_main_replica(replica_id: Any) -> Any:
    """The replica id with its data-parallel component set to 0 (each DP rank owns distinct rows)."""
    if isinstance(replica_id, tuple) and replica_id:
        return (*replica_id[:-1], 0)
    return 0


def _rows_sub_shard(template: ShardedTensor, data: torch.Tensor, lo: int, hi: int, row0: int) -> ShardedTensor:
    """The rows ``[lo, hi)`` (template-local coordinates) of ``template``, ``data`` holding rows from ``row0``."""
    axis = template.prepend_axis_num
    offset = list(template.global_offset)
    offset[axis] += lo
    piece = data[lo - row0:hi - row0]
    return replace(template, data=piece, dtype=piece.dtype, local_shape=tuple(piece.shape),
                   global_offset=tuple(offset), replica_id=_dp_main_replica(template.replica_id),
                   axis_fragmentations=None)


def _convert_tensor(sh: ShardedTensor, param: DTensor) -> ShardedTensor | None:
    start, end = local_row_range(param)
    if start == end:
        return None
    local = param.to_local()
    out = _rows_sub_shard(replace(sh, data=None), local, start, end, start)
    out.fsdp_param = param
    return out


def _convert_factory(sh: ShardedTensorFactory, param: DTensor) -> ShardedTensorFactory | None:
    """A factory whose pieces are this rank's rows of each chunk the original factory would write."""
    start, end = local_row_range(param)
    if start == end:
        return None
    templates = sh.build_fn(sh.key, torch.empty(param.shape, dtype=param.dtype, device="meta"), sh.replica_id, None)
    templates = list(templates.values()) if isinstance(templates, dict) else list(templates)
    bounds, row = [], 0
    for template in templates:
        if not isinstance(template, ShardedTensor) or template.local_shape[1:] != tuple(param.shape[1:]):
            raise CheckpointingException(
                f"{sh.key!r}: FSDP can only split factories whose chunks are stacked along dim 0"
            )
        bounds.append((row, row + template.local_shape[0]))
        row += template.local_shape[0]
    if row != param.shape[0]:
        raise CheckpointingException(f"{sh.key!r}: factory chunks cover {row} of {param.shape[0]} rows")

    def build_fn(key: str, data: torch.Tensor, replica_id: Any, flattened_range: Any) -> list[ShardedTensor]:
        pieces = []
        for template, (chunk_lo, chunk_hi) in zip(templates, bounds):
            lo, hi = max(chunk_lo, start), min(chunk_hi, end)
            if lo >= hi:
                continue
            axis = template.prepend_axis_num
            offset = list(template.global_offset)
            offset[axis] += lo - chunk_lo
            piece = data[lo - start:hi - start]
            pieces.append(replace(template, key=key, data=piece, dtype=piece.dtype, local_shape=tuple(piece.shape),
                                  global_offset=tuple(offset), replica_id=replica_id, axis_fragmentations=None))
        return pieces

    def merge_fn(sub_state_dict: Any) -> torch.Tensor:
        parts = list(sub_state_dict.values()) if isinstance(sub_state_dict, dict) else list(sub_state_dict)
        return torch.cat(parts, dim=0)

    out = ShardedTensorFactory(sh.key, param.to_local(), build_fn, merge_fn, _dp_main_replica(sh.replica_id))
    out.fsdp_param = param
    return out


def fsdp_sharded_state_dict(sharded_state_dict: dict[str, Any]) -> dict[str, Any]:
    """Rewrite every entry whose data is an FSDP DTensor into this rank's rows (see the module docstring).

    Entries of ranks that hold no rows of a small tensor are dropped (other ranks write them).
    """
    for name in list(sharded_state_dict):
        value = sharded_state_dict[name]
        if isinstance(value, dict):
            fsdp_sharded_state_dict(value)
            continue
        data = getattr(value, "data", None)
        if not is_fsdp_dtensor(data):
            continue
        if isinstance(value, ShardedTensorFactory):
            converted = _convert_factory(value, data)
        elif isinstance(value, ShardedTensor):
            converted = _convert_tensor(value, data)
        else:
            raise CheckpointingException(f"{name!r}: cannot describe a {type(value).__name__} of an FSDP DTensor")
        if converted is None:
            del sharded_state_dict[name]
        else:
            sharded_state_dict[name] = converted
    return sharded_state_dict
