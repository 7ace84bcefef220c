"""The one rule behind Megatron-Core's loss auto-scalers (``MoEAuxLossAutoScaler``, ``MTPLossAutoScaler``,
``DSAIndexerLossAutoScaler``).

An auto-scaler attaches a side loss to an activation: the forward returns the activation unchanged and keeps the
loss; the backward passes the activation's gradient through and gives every element of the loss the gradient
``main_loss_backward_scale`` (default 1), which the pipeline schedules set to the main loss's backward scale. So the
side loss is optimised with the main loss's scaling without being added to the reported loss.

Each subclass of :class:`LossAutoScaler` has its own ``main_loss_backward_scale`` class attribute, and that attribute
is the only place the scale is stored: ``set_loss_scale`` and plain assignment both write it. The backward reads it
through the class's ``__dict__`` (a mapping proxy) rather than as ``cls.main_loss_backward_scale``: torch.compile
can trace the former inside a compiled graph (torch >= 2.7) but not an attribute read on an ``autograd.Function``
class, which would break the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["LossAutoScaler"]


def _loss_gradient(loss: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``ones_like(loss) * scale`` (``ones_like(loss)`` without a scale).

    A 0-dim CPU scale multiplies as a scalar on any device (no host-to-device copy); any other scale moves to the
    loss's device first.
    """
    grad = torch.ones_like(loss)
    if scale is None:
        return grad
    if scale.device != loss.device and not (scale.dim() == 0 and scale.device.type == "cpu"):
        scale = scale.to(loss.device)
    return grad * scale


def _backward_reading(slots: Mapping[str, Any]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The backward of one auto-scaler class whose ``__dict__`` is ``slots``."""

    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``grad_output`` for the activation; ``main_loss_backward_scale`` (default 1) for each loss element."""
        (loss,) = ctx.saved_tensors
        return grad_output, _loss_gradient(loss, slots["main_loss_backward_scale"])

    return backward


class LossAutoScaler(torch.autograd.Function):
    """Identity on ``output`` whose backward sends ``main_loss_backward_scale`` (default 1) into ``loss``.

    Subclass it once per kind of side loss (the base itself has no backward): every subclass gets its own
    ``main_loss_backward_scale`` (``None`` unless its body sets a default) and a backward that reads it.
    ``set_loss_scale`` here stores ``torch.as_tensor(scale)``; subclasses override it where Megatron-Core stores the
    scale differently. An unset scale (``None``) means 1 and stays ``None`` (Megatron-Core writes a 1 into it).
    """

    main_loss_backward_scale: torch.Tensor | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give ``cls`` its own scale slot and a backward that reads it."""
        super().__init_subclass__(**kwargs)
        if "main_loss_backward_scale" not in vars(cls):
            cls.main_loss_backward_scale = None
        backward = _backward_reading(vars(cls))
        backward.__qualname__ = f"{cls.__qualname__}.backward"
        cls.backward = staticmethod(backward)

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """Return ``output`` unchanged and keep ``loss`` for the backward."""
        ctx.save_for_backward(loss)
        return output

    @classmethod
    def set_loss_scale(cls, scale: torch.Tensor) -> None:
        """Set the gradient every element of the loss receives (the schedules pass the main loss's backward
        scale, ``loss_scale / num_microbatches``)."""
        cls.main_loss_backward_scale = torch.as_tensor(scale)
