"""More of Megatron-Core's ``utils`` helpers: viewless tensors, model attributes, small arithmetic, and
aliases of helpers that live elsewhere in this library (re-exported by ``megatron_core.utils``)."""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from megatron_core._wrapped_model import get_attr_wrapped_model
from megatron_core.parallel_state.memory_buffer import GlobalMemoryBuffer

__all__ = [
    "GlobalMemoryBuffer", "MakeViewlessTensor", "WrappedTensor", "accepts_parameter", "assert_viewless_tensor",
    "get_model_type", "get_model_xattn", "is_submodule", "is_using_quantization_scales", "log_on_each_pipeline_stage",
    "make_viewless_tensor",
    "round_up_to_nearest_multiple", "safely_set_viewless_tensor_data",
]


def round_up_to_nearest_multiple(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    if multiple <= 0:
        raise ValueError(f"multiple={multiple} must be positive")
    return math.ceil(value / multiple) * multiple


def is_using_quantization_scales(config: Any) -> Any:
    """Whether ``config`` turns on FP8 or FP4 training (a truthy ``fp8`` or ``fp4``, e.g. ``"e4m3"``); the
    configured value itself is returned, as Megatron-Core does."""
    return getattr(config, "fp8", False) or getattr(config, "fp4", False)


def accepts_parameter(func: Callable[..., Any], name: str) -> bool:
    """Whether ``func`` takes a parameter ``name`` (or ``**kwargs``)."""
    return any(p.name == name or p.kind == inspect.Parameter.VAR_KEYWORD
               for p in inspect.signature(func).parameters.values())


def get_model_type(model: Any) -> Any:
    """``model_type`` of a possibly wrapped model."""
    return get_attr_wrapped_model(model, "model_type")


def get_model_xattn(model: Any) -> bool:
    """``xattn_needed`` of a possibly wrapped model (False when absent)."""
    try:
        return get_attr_wrapped_model(model, "xattn_needed")
    except RuntimeError:
        return False


def is_submodule(module: torch.nn.Module, parent_module: torch.nn.Module, strict: bool = True) -> bool:
    """Whether ``module`` is inside ``parent_module`` (itself counts unless ``strict``)."""
    if strict and module is parent_module:
        return False
    return any(m is module for m in parent_module.modules())


def log_on_each_pipeline_stage(logger: logging.Logger, *args: Any, tp_group: Any = None, dp_cp_group: Any = None,
                               **kwargs: Any) -> None:
    """``logger.log(*args, **kwargs)`` on TP rank 0 and DP x CP rank 0 of every pipeline stage."""
    from megatron_core import parallel_state

    if (tp_group is None) != (dp_cp_group is None):
        raise ValueError("log_on_each_pipeline_stage: give both tp_group and dp_cp_group, or neither")
    if tp_group is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    else:
        tp_rank, dp_rank = tp_group.rank(), dp_cp_group.rank()
    if tp_rank == 0 and dp_rank == 0:
        logger.log(*args, **kwargs)


def _viewless(inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    out = torch.empty((1,), dtype=inp.dtype, device=inp.device, requires_grad=requires_grad)
    out.data = inp.data
    return out


class MakeViewlessTensor(torch.autograd.Function):
    """A tensor sharing ``inp``'s storage but not keeping its ``_base`` alive, inside the autograd graph."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        """The viewless tensor."""
        return _viewless(inp, requires_grad)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """Gradient passes through."""
        return grad_output, None


def make_viewless_tensor(inp: torch.Tensor, requires_grad: bool, keep_graph: bool) -> torch.Tensor:
    """``inp`` if it is not a view, else a tensor on the same data with no ``_base`` (in the graph if ``keep_graph``)."""
    if inp._base is None:
        return inp
    return MakeViewlessTensor.apply(inp, requires_grad) if keep_graph else _viewless(inp, requires_grad)


def assert_viewless_tensor(tensor: Any, extra_msg: str | None = None) -> Any:
    """Raise ``ValueError`` if ``tensor`` (or any tensor of a list) is a view; return it."""
    if isinstance(tensor, list):
        for t in tensor:
            assert_viewless_tensor(t, extra_msg)
        return tensor
    if isinstance(tensor, torch.Tensor) and tensor._base is not None:
        raise ValueError(f"tensor is a view (its ._base is set): setting .data or storing it keeps the base "
                         f"alive and leaks memory. {extra_msg or ''}")
    return tensor


def safely_set_viewless_tensor_data(tensor: torch.Tensor, new_data_tensor: torch.Tensor) -> None:
    """``tensor.data = new_data_tensor`` after checking that ``tensor`` is not a view."""
    assert_viewless_tensor(tensor, extra_msg=f"new data has shape {tuple(new_data_tensor.shape)}")
    tensor.data = new_data_tensor


class WrappedTensor:
    """Holds a tensor so a callee can take (and free) it: ``unwrap()`` returns it once."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._wrapper = [tensor]

    def unwrap(self) -> torch.Tensor:
        """The tensor; ``RuntimeError`` on a second call."""
        if not self._wrapper:
            raise RuntimeError("WrappedTensor has already been unwrapped")
        return self._wrapper.pop()
