"""Megatron-Core's ``fp8_utils``: FP8 tensor predicates, parameter-storage helpers and FP8 layer rules.

This library's FP8 training (:mod:`megatron_core.fp8`) either keeps no amax history (torchao's dynamic
recipes) or, with ``fp8_recipe='delayed'``, restores its histories exactly from each layer's
``_extra_state`` (no checkpoint-load copy writes into them), so the Transformer Engine 1.x repair of amax
histories after a checkpoint load has nothing to do here; Megatron-Core's own function does nothing either
with Transformer Engine 2 or without it.

The FP8-parameter helpers Megatron-Core's distributed optimizer and DDP buffers call (``is_float8tensor``,
``dequantize_fp8_tensor``, ``quantize_param_shard``, ``copy_tensor_to_quantized_param``,
``modify_underlying_storage``, ``post_all_gather_processing``) act on this library's FP8 parameters
(:mod:`megatron_core.distributed.fp8_params`; ``fp8_param``: tensorwise scales for the dense layers, row-wise for
the MoE experts' grouped weights) and, where Megatron-Core's do, on Transformer Engine's quantized tensors. The
predicates of Transformer Engine's tensor classes (``is_mxfp8tensor``, ``is_grouped_tensor``, ...) are False for
every other tensor, ours included; they never import Transformer Engine: a tensor can only be an instance of one of
its classes once its module is loaded, so they look the class up among the loaded modules.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from megatron_core._ground.te_tensors import TE_GROUPED, TE_TENSOR_MODULE, grouped_quantized_recipe
from megatron_core._ground.te_tensors import is_te_instance as _is_te_instance
from megatron_core._ground.te_tensors import unwrap_grouped as _grouped
from megatron_core.distributed.fp8_params import (
    copy_tensor_to_quantized_param,
    dequantize_fp8_tensor,
    quantize_param_shard,
)
from megatron_core.distributed.fp8_params import is_fp8_param as is_float8tensor
from megatron_core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["HAVE_TE", "HAVE_TE_FP8_TENSOR_CLASS", "copy_tensor_to_quantized_param", "correct_amax_history_if_needed",
           "dequantize_fp8_tensor", "get_fp8_align_size", "get_fp8_context", "get_grouped_quantized_members",
           "is_column_parallel_linear", "is_first_last_bf16_layer", "is_float8tensor", "is_grouped_mxfp8tensor",
           "is_grouped_tensor", "is_grouped_tensor_with_quantized_storage", "is_mxfp8_output_proj_active",
           "is_mxfp8tensor", "is_row_parallel_linear", "modify_grouped_tensor_rowwise_storage",
           "modify_underlying_storage", "post_all_gather_processing", "quantize_param_shard"]

# The test of ``extensions._te_loader.HAVE_TE``, repeated: ``extensions`` imports ``transformer``, which imports this
# module, so importing it here would close a cycle between the parts.
HAVE_TE: bool = importlib.util.find_spec("transformer_engine") is not None
"""Whether Transformer Engine is installed (found on the path; not imported)."""

HAVE_TE_FP8_TENSOR_CLASS: bool = HAVE_TE
"""Whether Transformer Engine's FP8 tensor class exists (every Transformer Engine release has one)."""

_TE_TENSOR = TE_TENSOR_MODULE
_TE_QUANTIZED = (_TE_TENSOR, "QuantizedTensor")
_TE_MXFP8 = (f"{_TE_TENSOR}.mxfp8_tensor", "MXFP8Tensor")


def is_mxfp8tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is Transformer Engine's ``MXFP8Tensor`` (never one of this library's FP8 parameters)."""
    return _is_te_instance(tensor, _TE_MXFP8)


def is_grouped_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is Transformer Engine's ``GroupedTensor`` (this library's grouped expert weights are plain
    3-D tensors: False)."""
    return _is_te_instance(tensor, TE_GROUPED)


def is_grouped_tensor_with_quantized_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a Transformer Engine ``GroupedTensor`` whose primary (row-wise) storage is quantized
    bytes."""
    if not is_grouped_tensor(tensor):
        return False
    rowwise = getattr(_grouped(tensor), "rowwise_data", None)
    return rowwise is not None and rowwise.dtype == torch.uint8


def is_grouped_mxfp8tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a quantized Transformer Engine ``GroupedTensor`` whose quantizer's recipe is MXFP8."""
    recipe = grouped_quantized_recipe(tensor)
    return recipe is not None and hasattr(recipe, "mxfp8") and bool(recipe.mxfp8())


def get_grouped_quantized_members(tensor: torch.Tensor, *, create_if_missing: bool = False) -> list[torch.Tensor]:
    """The per-member quantized tensors of a quantized Transformer Engine ``GroupedTensor``, cached on it.

    ``ValueError`` for any other tensor; ``RuntimeError`` when the cache is empty and ``create_if_missing`` is
    False (splitting is not done on the training's critical path).
    """
    if not is_grouped_tensor_with_quantized_storage(tensor):
        raise ValueError("get_grouped_quantized_members expects a Transformer Engine GroupedTensor with quantized "
                         f"storage; got {type(tensor).__name__} of dtype {getattr(tensor, 'dtype', None)}")
    grouped = _grouped(tensor)
    members = getattr(grouped, "quantized_tensors", None)
    if members is None:
        if not create_if_missing:
            raise RuntimeError("the grouped quantized parameter has no cached member tensors; create them "
                               "(create_if_missing=True) outside the training's critical path")
        members = grouped.split_into_quantized_tensors()
        grouped.quantized_tensors = members
    return members


def modify_grouped_tensor_rowwise_storage(tensor: torch.Tensor, new_storage: torch.Tensor) -> None:
    """Move a high-precision Transformer Engine ``GroupedTensor``'s row-wise storage into ``new_storage`` (same
    number of elements and dtype; the values are copied and the column-wise data and member cache dropped).

    ``ValueError`` for any other tensor and for quantized grouped storage (which also owns scale buffers).
    """
    if not is_grouped_tensor(tensor):
        raise ValueError(f"modify_grouped_tensor_rowwise_storage expects a Transformer Engine GroupedTensor; got "
                         f"{type(tensor).__name__}")
    if is_grouped_tensor_with_quantized_storage(tensor):
        raise ValueError("modify_grouped_tensor_rowwise_storage supports only high-precision GroupedTensor storage "
                         "(quantized grouped storage also owns scale buffers)")
    grouped = _grouped(tensor)
    old = getattr(grouped, "rowwise_data", None)
    if old is None:
        raise RuntimeError("the GroupedTensor has no rowwise_data")
    flat = new_storage.view(-1)
    if flat.numel() != old.numel() or flat.dtype != old.dtype:
        raise ValueError(f"modify_grouped_tensor_rowwise_storage: new storage has {flat.numel()} elements of "
                         f"{flat.dtype}, the GroupedTensor's {old.numel()} of {old.dtype}")
    flat.detach().copy_(old)
    grouped.rowwise_data = flat
    grouped.columnwise_data = None
    grouped.quantized_tensors = None


def modify_underlying_storage(tensor: torch.Tensor, new_raw_data: torch.Tensor) -> None:
    """Move an FP8 parameter's bytes into ``new_raw_data`` (e.g. its slice of DDP's parameter buffer) and make the
    parameter use it: the bytes are copied, then the parameter's data is a view of ``new_raw_data``.

    This library's FP8 parameters take a 1-byte ``new_raw_data`` (``uint8`` or float8) of the same number of
    elements; Transformer Engine's quantized tensors go to Transformer Engine's ``replace_raw_data``. Any other
    tensor raises ``ValueError`` (a plain parameter is moved by setting ``.data``).
    """
    if is_float8tensor(tensor):
        if new_raw_data.element_size() != 1 or new_raw_data.numel() != tensor.numel():
            raise ValueError(f"modify_underlying_storage: an FP8 parameter of {tensor.numel()} elements needs "
                             f"{tensor.numel()} bytes; got {new_raw_data.numel()} elements of {new_raw_data.dtype}")
        view = new_raw_data.view(tensor.dtype) if new_raw_data.dtype != tensor.dtype else new_raw_data
        view = view.view(tensor.shape)
        view.detach().copy_(tensor.data)
        tensor.data = view
        return
    if _is_te_instance(tensor, _TE_QUANTIZED):
        utils = importlib.import_module(f"{_TE_TENSOR}.utils")
        utils.replace_raw_data(tensor, new_raw_data)
        return
    raise ValueError(f"modify_underlying_storage expects an FP8 parameter (fp8_param) or a Transformer Engine "
                     f"quantized tensor; got {type(tensor).__name__} of dtype {tensor.dtype}")


def _refresh_fp8_transpose(param: torch.Tensor) -> None:
    """Rewrite an FP8 parameter's cached transposed codes (``fp8_transpose``) from its current bytes: ``[in, out]``
    of a dense weight ``[out, in]``, ``[E, in, out]`` of the experts' grouped weight ``[E, out, in]``."""
    cache = getattr(param, "fp8_transpose", None)
    if cache is None or param.dim() not in (2, 3):
        return
    transposed = param.detach().transpose(-2, -1)
    if cache.shape == transposed.shape:
        with torch.no_grad():
            cache.copy_(transposed)


def post_all_gather_processing(model_params: torch.Tensor | list[torch.Tensor]) -> None:
    """Bring the derived forms of FP8 weights up to date after the parameter all-gather wrote their bytes.

    This library's FP8 parameters that carry the backward's transposed-codes cache (``fp8_transpose``, given by
    ``set_is_first_microbatch``) have it rewritten from the gathered bytes; a quantized Transformer Engine
    ``GroupedTensor`` counts as its members; Transformer Engine's quantized tensors go to its
    ``post_all_gather_processing`` where it has one (column-wise / transposed data), as in Megatron-Core. Other
    tensors are left alone.
    """
    params = model_params if isinstance(model_params, (list, tuple)) else [model_params]
    te_params: list[torch.Tensor] = []
    for param in params:
        if is_float8tensor(param):
            _refresh_fp8_transpose(param)
        elif is_grouped_tensor_with_quantized_storage(param):
            te_params.extend(get_grouped_quantized_members(param))
        elif _is_te_instance(param, _TE_QUANTIZED):
            te_params.append(param)
    if not te_params:
        return
    try:
        te_post = importlib.import_module(f"{_TE_TENSOR}.utils").post_all_gather_processing
    except (ImportError, AttributeError):
        return  # older Transformer Engine: the transposed data is made in the next forward
    te_post(te_params)


def get_fp8_align_size(fp8_recipe: Any) -> int:
    """The multiple an FP8 GEMM's dimensions must be padded to: 32 for ``'mxfp8'``, else 16."""
    return 32 if getattr(fp8_recipe, "value", fp8_recipe) == "mxfp8" else 16


_TE_WRAPPERS = "megatron_core.extensions.transformer_engine"


def _is_te_wrapper(module: Any, names: tuple[str, ...]) -> bool:
    """Whether ``module`` is an instance of one of the Transformer Engine wrappers ``names`` of
    :mod:`megatron_core.extensions.transformer_engine` (none exists before that module is loaded)."""
    wrappers = sys.modules.get(_TE_WRAPPERS)
    classes = tuple(getattr(wrappers, name) for name in names) if wrappers is not None else ()
    return bool(classes) and isinstance(module, classes)


def is_column_parallel_linear(module: Any) -> bool:
    """Whether ``module`` is a column-parallel linear layer: ``ColumnParallelLinear`` (its FP8 and other
    subclasses included) or Transformer Engine's ``TEColumnParallelLinear`` / ``TELayerNormColumnParallelLinear``."""
    return isinstance(module, ColumnParallelLinear) or _is_te_wrapper(
        module, ("TEColumnParallelLinear", "TELayerNormColumnParallelLinear"))


def is_row_parallel_linear(module: Any) -> bool:
    """Whether ``module`` is a row-parallel linear layer: ``RowParallelLinear`` (subclasses included) or
    ``TERowParallelLinear``."""
    return isinstance(module, RowParallelLinear) or _is_te_wrapper(module, ("TERowParallelLinear",))


def is_first_last_bf16_layer(config: Any, layer_no: int) -> bool:
    """Whether the layer of 0-based *global* index ``layer_no`` stays in high precision in an FP8 model: with
    ``config.first_last_layers_bf16``, the first ``num_layers_at_start_in_bf16`` and last
    ``num_layers_at_end_in_bf16`` layers. A negative ``layer_no`` (no particular layer) gives False.

    The one rule: :func:`megatron_core.fp8.convert_to_float8` leaves these layers unconverted.
    """
    if layer_no < 0 or not getattr(config, "first_last_layers_bf16", False):
        return False
    return (layer_no < config.num_layers_at_start_in_bf16
            or layer_no >= config.num_layers - config.num_layers_at_end_in_bf16)


def is_mxfp8_output_proj_active(config: Any) -> bool:
    """Whether the output (LM-head) projection runs under MXFP8: Transformer Engine installed, ``fp8_output_proj``,
    ``fp8`` and ``fp8_recipe='mxfp8'``. ``TransformerConfig`` here refuses ``fp8_output_proj=True``, so this is
    False for every model of this library."""
    if not HAVE_TE or not getattr(config, "fp8_output_proj", False) or not getattr(config, "fp8", None):
        return False
    recipe = getattr(config, "fp8_recipe", None)
    return str(getattr(recipe, "value", recipe)).lower() == "mxfp8"


def get_fp8_context(config: Any, layer_no: int = -1, is_init: bool = False) -> AbstractContextManager:
    """The context Megatron-Core enters around a layer's forward (``is_init=False``) or construction.

    Always a ``nullcontext()`` here, as in Megatron-Core without Transformer Engine: this library's FP8
    GEMMs are chosen when the layers are built (``megatron_core.fp8``, from ``config.fp8``, the
    first/last BF16 layers and ``config.quant_recipe``), not by a surrounding autocast.
    """
    return nullcontext()


def correct_amax_history_if_needed(model: list[torch.nn.Module] | torch.nn.Module) -> None:
    """Repair FP8 amax histories after loading a checkpoint (Megatron-Core's call); a no-op in this library,
    whose delayed-scaling histories load exactly from ``_extra_state``. ``TypeError`` unless given a module or a list of modules."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(f"correct_amax_history_if_needed expects torch.nn.Module chunks, got {type(chunk).__name__}")
