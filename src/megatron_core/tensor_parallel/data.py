"""Send one batch from TP rank 0 to its tensor-parallel peers (Megatron-Core's ``broadcast_data``).

Only TP rank 0 reads the data loader; the others pass ``data=None`` (or anything) and receive.
Two broadcasts: first the shapes (up to ``_MAX_DATA_DIM`` dims per key, as int64), then all
tensors flattened into one buffer of ``datatype``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core.device import get_current_device
from megatron_core.tensor_parallel.groups import get_tensor_model_parallel_group_if_none, group_rank
from megatron_core.tensor_parallel.mappings import _broadcast_

_MAX_DATA_DIM = 5


def _check_data_types(keys: list[str], data: dict[str, torch.Tensor], target_dtype: torch.dtype) -> None:
    for key in keys:
        if data[key].dtype != target_dtype:
            raise ValueError(f"broadcast_data: '{key}' has dtype {data[key].dtype}, expected {target_dtype}")


def _shapes_on_rank0(keys: list[str], data: dict | None, tp_group) -> dict[str, tuple[int, ...]]:
    sizes = torch.zeros(_MAX_DATA_DIM * len(keys), dtype=torch.long)
    if group_rank(tp_group) == 0:
        for i, key in enumerate(keys):
            shape = data[key].shape
            if len(shape) > _MAX_DATA_DIM or len(shape) == 0 or 0 in shape:
                raise ValueError(
                    f"broadcast_data: '{key}' has shape {tuple(shape)}; needs 1 to {_MAX_DATA_DIM} non-empty dims"
                )
            sizes[i * _MAX_DATA_DIM : i * _MAX_DATA_DIM + len(shape)] = torch.tensor(shape)
    sizes = _broadcast_(sizes.to(get_current_device()), tp_group).cpu()
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
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    shapes = _shapes_on_rank0(keys, data, tp_group)
    numels = {key: int(torch.Size(shape).numel()) for key, shape in shapes.items()}
    device = get_current_device()
    if group_rank(tp_group) == 0:
        _check_data_types(keys, data, datatype)
        flat = torch.cat([data[key].contiguous().view(-1) for key in keys], dim=0).to(device)
    else:
        flat = torch.empty(sum(numels.values()), dtype=datatype, device=device)
    _broadcast_(flat, tp_group)
    output, offset = {}, 0
    for key in keys:
        output[key] = flat.narrow(0, offset, numels[key]).view(shapes[key])
        offset += numels[key]
    return output
