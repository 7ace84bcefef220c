"""The DSA indexer loss's auto-scaler (Megatron-Core's ``experimental_attention_variant.dsa``; no DSA attention).

An auxiliary loss attached to an activation: the forward returns the activation unchanged and keeps the
loss; the backward passes the activation's gradient through and gives the loss the gradient
``main_loss_backward_scale`` (set by the schedules from the main loss's scale, like MoE's and MTP's).
"""

from __future__ import annotations

import torch

__all__ = ["DSAIndexerLossAutoScaler"]


class DSAIndexerLossAutoScaler(torch.autograd.Function):
    """Attach the indexer loss to ``output`` so that its backward runs with the main loss's scale."""

    main_loss_backward_scale: torch.Tensor | None = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, indexer_loss: torch.Tensor) -> torch.Tensor:
        """Return ``output`` unchanged; keep ``indexer_loss`` for the backward."""
        ctx.save_for_backward(indexer_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The activation's gradient, and ``main_loss_backward_scale`` (default 1) for the loss."""
        (indexer_loss,) = ctx.saved_tensors
        scale = DSAIndexerLossAutoScaler.main_loss_backward_scale
        scale = torch.ones((), device=indexer_loss.device) if scale is None else scale.to(indexer_loss.device)
        return grad_output, torch.ones_like(indexer_loss) * scale

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Set the scale of the indexer loss's gradient (the schedules call this each micro-batch)."""
        if not isinstance(scale, torch.Tensor):
            raise TypeError("DSAIndexerLossAutoScaler.set_loss_scale requires a torch.Tensor")
        scale = scale.detach()
        if DSAIndexerLossAutoScaler.main_loss_backward_scale is None:
            DSAIndexerLossAutoScaler.main_loss_backward_scale = scale
        else:
            DSAIndexerLossAutoScaler.main_loss_backward_scale.copy_(scale)
