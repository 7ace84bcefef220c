"""Megatron-Core's ``fp4_utils``: recognising Transformer Engine's NVFP4 tensors and re-pointing their bytes.

An NVFP4 parameter is Transformer Engine's ``NVFP4Tensor`` (or a ``GroupedTensor`` of NVFP4 members): its
logical shape is that of the high-precision weight, while its row-wise data packs two 4-bit values per byte,
a ``uint8`` tensor whose last dimension is half the logical one. DDP's parameter buffer holds exactly these
packed bytes (:mod:`megatron_core.distributed.param_and_grad_buffer`'s ``nvfp4_packed_param_index_map``); the
scales, amax and column-wise data stay with the tensor.

This library makes no NVFP4 parameters of its own: without Transformer Engine the predicates are False. They
never import Transformer Engine (:mod:`megatron_core._ground.te_tensors`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._ground.te_tensors import (
    TE_TENSOR_MODULE,
    grouped_quantized_recipe,
    is_te_instance,
    unwrap_grouped,
)

__all__ = ["get_nvfp4_rowwise_packed_shape", "is_grouped_nvfp4tensor", "is_nvfp4tensor",
           "modify_grouped_nvfp4_rowwise_storage", "modify_nvfp4_rowwise_storage"]

_TE_NVFP4 = (f"{TE_TENSOR_MODULE}.nvfp4_tensor", "NVFP4Tensor")


def is_nvfp4tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is Transformer Engine's ``NVFP4Tensor`` (False for every tensor without TE)."""
    return is_te_instance(tensor, _TE_NVFP4)


def is_grouped_nvfp4tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a Transformer Engine ``GroupedTensor`` of quantized bytes whose recipe is NVFP4."""
    recipe = grouped_quantized_recipe(tensor)
    return recipe is not None and hasattr(recipe, "nvfp4") and bool(recipe.nvfp4())


def get_nvfp4_rowwise_packed_shape(shape: torch.Size | tuple[int, ...]) -> torch.Size:
    """The shape of an NVFP4 tensor's row-wise bytes: ``shape`` with its last dimension halved (two values per
    byte); a 0-d shape is returned as is. ``ValueError`` when the last dimension is odd."""
    shape = torch.Size(shape)
    if len(shape) == 0:
        return shape
    if shape[-1] % 2:
        raise ValueError(f"NVFP4 packs two values per byte: the last dimension of shape {tuple(shape)} "
                         f"({shape[-1]}) must be even")
    return torch.Size((*shape[:-1], shape[-1] // 2))


def _check_bytes(old: torch.Tensor | None, new: torch.Tensor, what: str) -> None:
    """``ValueError`` unless ``old`` exists and ``old`` and ``new`` are ``uint8`` bytes of the same count."""
    if old is None:
        raise ValueError(f"{what}: the tensor has no row-wise data to replace")
    if old.dtype != torch.uint8 or new.dtype != torch.uint8:
        raise ValueError(f"{what}: row-wise NVFP4 storage must be uint8 (old {old.dtype}, new {new.dtype})")
    if old.numel() != new.numel():
        raise ValueError(f"{what}: the new storage has {new.numel()} bytes, the row-wise data {old.numel()}")


def modify_nvfp4_rowwise_storage(fp4_tensor: Any, new_rowwise_data: torch.Tensor) -> None:
    """Make ``new_rowwise_data`` (``uint8``, e.g. a view of DDP's parameter buffer) the row-wise bytes of the
    NVFP4 tensor ``fp4_tensor``, after copying the current bytes into it. ``ValueError`` for any other tensor."""
    if not is_nvfp4tensor(fp4_tensor):
        raise ValueError(f"modify_nvfp4_rowwise_storage expects a Transformer Engine NVFP4Tensor, got "
                         f"{type(fp4_tensor).__name__}")
    old = getattr(fp4_tensor, "_rowwise_data", None)
    _check_bytes(old, new_rowwise_data, "modify_nvfp4_rowwise_storage")
    new_rowwise_data.detach().copy_(old.reshape(new_rowwise_data.shape))
    fp4_tensor._rowwise_data = new_rowwise_data


def modify_grouped_nvfp4_rowwise_storage(grouped_tensor: Any, new_rowwise_data: torch.Tensor) -> None:
    """Make ``new_rowwise_data`` (``uint8``) the row-wise bytes of a grouped NVFP4 tensor, after copying the
    current bytes into it, and rebuild its member tensors (they hold pointers into the old bytes). Scales,
    amax and column-wise data stay where they are. ``ValueError`` for any other tensor."""
    grouped = unwrap_grouped(grouped_tensor)
    if not is_grouped_nvfp4tensor(grouped):
        raise ValueError(f"modify_grouped_nvfp4_rowwise_storage expects a Transformer Engine GroupedTensor with "
                         f"NVFP4 storage, got {type(grouped_tensor).__name__}")
    old = getattr(grouped, "rowwise_data", None)
    new_flat = new_rowwise_data.view(-1)
    _check_bytes(old, new_flat, "modify_grouped_nvfp4_rowwise_storage")
    new_flat.detach().copy_(old.view(-1))
    grouped.rowwise_data = new_flat
    grouped.quantized_tensors = grouped.split_into_quantized_tensors()
