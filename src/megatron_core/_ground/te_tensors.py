"""Recognising Transformer Engine's tensor classes without importing Transformer Engine.

Transformer Engine (TE) is optional; the one place that imports it is
:mod:`megatron_core.extensions._te_loader`. A tensor can only be an instance of one of TE's classes once the
module defining that class is loaded, so the predicates of :mod:`megatron_core.fp8_utils` and
:mod:`megatron_core.fp4_utils` look the class up among the loaded modules: without TE (or before TE is used)
every such predicate is False and nothing is imported.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["TE_GROUPED", "TE_TENSOR_MODULE", "grouped_quantized_recipe", "is_te_instance", "loaded_te_class", "unwrap_grouped"]

TE_TENSOR_MODULE = "transformer_engine.pytorch.tensor"
"""The package of TE's tensor classes (``QuantizedTensor``, ``MXFP8Tensor``, ``NVFP4Tensor``, ...)."""

TE_GROUPED = (f"{TE_TENSOR_MODULE}.grouped_tensor", "GroupedTensor")
"""TE's ``GroupedTensor`` class, as (module, name)."""


def loaded_te_class(where: tuple[str, str]) -> type | None:
    """TE's class ``where`` = (module, name) if its module is loaded, else None."""
    module = sys.modules.get(where[0])
    cls = getattr(module, where[1], None) if module is not None else None
    return cls if isinstance(cls, type) else None


def is_te_instance(tensor: Any, where: tuple[str, str]) -> bool:
    """Whether ``tensor`` (or the data of a parameter wrapping it) is an instance of TE's class ``where``."""
    cls = loaded_te_class(where)
    if cls is None:
        return False
    return isinstance(tensor, cls) or (isinstance(tensor, torch.nn.Parameter) and isinstance(tensor.data, cls))


def unwrap_grouped(tensor: Any) -> Any:
    """The TE ``GroupedTensor`` itself: a parameter's data unless the parameter is the grouped tensor (its storage
    lives in Python attributes that ``.data`` would not share)."""
    cls = loaded_te_class(TE_GROUPED)
    if cls is not None and isinstance(tensor, cls):
        return tensor
    return tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor


def grouped_quantized_recipe(tensor: Any) -> Any:
    """The recipe of a TE ``GroupedTensor`` whose row-wise storage is quantized bytes (``uint8``), from its
    quantizer; None for any other tensor, or when the quantizer names no recipe."""
    if not is_te_instance(tensor, TE_GROUPED):
        return None
    grouped = unwrap_grouped(tensor)
    rowwise = getattr(grouped, "rowwise_data", None)
    if rowwise is None or rowwise.dtype != torch.uint8:
        return None
    quantizer = getattr(grouped, "quantizer", None)
    if quantizer is None or not hasattr(quantizer, "_get_compatible_recipe"):
        return None
    return quantizer._get_compatible_recipe()
