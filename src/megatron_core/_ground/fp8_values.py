"""The value of an FP8 parameter: its float8 codes divided by its scale(s), in its high-precision dtype.

An FP8 parameter (made by :func:`megatron_core.distributed.fp8_params.make_fp8_param`) is a float8 tensor
carrying ``is_fp8_param``, ``fp8_scaling`` (``'tensorwise'``: one scale; ``'rowwise'``: one per slice along
the last dimension), ``fp8_scale`` and ``fp8_hp_dtype``. Reading its value needs nothing but these
attributes, so it sits on the ground floor, where checkpointing (below the DDP buffers that make such
parameters) can read it too.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["dequantize_fp8_tensor", "is_fp8_param"]


def is_fp8_param(tensor: Any) -> bool:
    """Whether ``tensor`` is an FP8 parameter made by ``make_fp8_param``."""
    return bool(getattr(tensor, "is_fp8_param", False))


def _rowwise(param: torch.Tensor) -> bool:
    return getattr(param, "fp8_scaling", "tensorwise") == "rowwise"


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, shape[-1]]``."""
    return t.reshape(-1, t.shape[-1])


def dequantize_fp8_tensor(fp8_tensor: torch.Tensor) -> torch.Tensor:
    """The high-precision value (``fp8_hp_dtype``) of an FP8 parameter."""
    codes = fp8_tensor.detach().float()
    if _rowwise(fp8_tensor):
        return (_rows(codes) / fp8_tensor.fp8_scale[:, None]).view(codes.shape).to(fp8_tensor.fp8_hp_dtype)
    return (codes / fp8_tensor.fp8_scale).to(fp8_tensor.fp8_hp_dtype)
