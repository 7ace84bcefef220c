"""Send one batch from TP rank 0 to its tensor-parallel peers (Megatron-Core's ``broadcast_data``).

Only TP rank 0 reads the data loader; the others pass ``data=None`` (or anything) and receive.
Two broadcasts: first the shapes (up to ``_MAX_DATA_DIM`` dims per key, as int64) with a flag
saying whether rank 0's batch is valid, so that a bad batch raises on every TP rank instead of
leaving the peers waiting; then all tensors flattened into one buffer of ``datatype``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_rank
from megatron_core.device import get_current_device
from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.tensor_parallel.mappings import _broadcast_

_MAX_DATA_DIM = 5


def _validate(keys: list[str], data: dict[str, torch.Tensor] | None, datatype: torch.dtype) -> str | None:
    """The reason TP rank 0's batch cannot be sent, or ``None``."""
    if data is None:
        return "TP rank 0 passed data=None"
    for key in keys:
        if key not in data:
            return f"'{key}' is missing from the batch (keys: {sorted(data)})"
        shape = tuple(data[key].shape)
        if not 1 <= len(shape) <= _MAX_DATA_DIM or 0 in shape:
            return f"'{key}' has shape {shape}; needs 1 to {_MAX_DATA_DIM} non-empty dims"
        if data[key].dtype != datatype:
            return f"'{key}' has dtype {data[key].dtype}, expected {datatype}"
    return None


def _shapes_from_rank0(keys: list[str], data: dict | None, datatype: torch.dtype,
                       tp_group) -> dict[str, tuple[int, ...]]:
    """Broadcast every key's shape; a trailing flag tells the peers whether rank 0 rejected the batch."""
    sizes = torch.zeros(_MAX_DATA_DIM * len(keys) + 1, dtype=torch.long)
    error = None
    if get_pg_rank(tp_group) == 0:
        error = _validate(keys, data, datatype)
        if error is None:
            for i, key in enumerate(keys):
                shape = data[key].shape
                sizes[i * _MAX_DATA_DIM : i * _MAX_DATA_DIM + len(shape)] = torch.tensor(shape)
            sizes[-1] = 1
    sizes = _broadcast_(sizes.to(get_current_device()), tp_group).cpu()
    if error is not None:
        raise ValueError(f"broadcast_data: {error}")
    if sizes[-1] != 1:
        raise ValueError("broadcast_data: TP rank 0 rejected its batch (its error names the problem)")
    shapes = {}
    for i, key in enumerate(keys):
        dims = sizes[i * _MAX_DATA_DIM : (i + 1) * _MAX_DATA_DIM].tolist()
        shapes[key] = tuple(d for d in dims if d > 0)
    return shapes


def broadcast_data(
    keys: list[str], data: dict[str, torch.Tensor] | None, datatype: torch.dtype,
    tp_group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Return ``{key: tensor}`` on every TP rank, as held by TP rank 0 (on the current device)."""
    tp_group = resolve_tp_group(tp_group)
    shapes = _shapes_from_rank0(keys, data, datatype, tp_group)
    numels = {key: int(torch.Size(shape).numel()) for key, shape in shapes.items()}
    device = get_current_device()
    if get_pg_rank(tp_group) == 0:
        flat = torch.cat([data[key].contiguous().view(-1) for key in keys], dim=0).to(device)
    else:
        flat = torch.empty(sum(numels.values()), dtype=datatype, device=device)
    _broadcast_(flat, tp_group)
    output, offset = {}, 0
    for key in keys:
        output[key] = flat.narrow(0, offset, numels[key]).view(shapes[key])
        offset += numels[key]
    return output
