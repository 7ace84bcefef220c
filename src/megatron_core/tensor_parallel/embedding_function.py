"""The embedding lookup of ``gradient_accumulation_fusion``: its weight gradient goes straight into ``main_grad``.

Without it, autograd builds the lookup's weight gradient as a dense ``[vocab, hidden]`` tensor in the weight's
dtype (a fill, a sort of the token ids, a segmented sum) and DDP's hook then adds it to the fp32 ``main_grad``
(another pass over ``vocab x hidden``). Here the backward adds each token's output gradient to its row of
``main_grad`` (:func:`~megatron_core.tensor_parallel.wgrad_accumulation.accumulate_embedding_gradient`), and
returns a placeholder ``.grad`` that DDP's hook ignores, as the fused linear layers do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.tensor_parallel.wgrad_accumulation import (
    accumulate_embedding_gradient,
    finish_fused_weight_gradient,
)

__all__ = ["embedding_with_grad_accumulation"]


class _EmbeddingWithGradAccumulation(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose weight gradient is accumulated into ``weight.main_grad``."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, deterministic: bool) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.deterministic = weight, deterministic
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        flat_ids, flat_grad = ids.reshape(-1), grad_output.reshape(-1, grad_output.shape[-1])
        if torch.compiler.is_compiling():
            torch.ops.megatron_core.accumulate_embedding_gradient(weight.main_grad, flat_ids, flat_grad,
                                                                  ctx.deterministic)
        else:
            accumulate_embedding_gradient(weight.main_grad, flat_ids, flat_grad, ctx.deterministic)
        return None, finish_fused_weight_gradient(weight), None


def embedding_with_grad_accumulation(ids: torch.Tensor, weight: torch.Tensor, deterministic: bool = False
                                     ) -> torch.Tensor:
    """``F.embedding(ids, weight)``; the backward adds the weight gradient to ``weight.main_grad`` (fp32).

    ``weight`` must have ``main_grad`` (DDP's gradient buffer view) and be marked ``wgrad_fused_into_main_grad``
    so that DDP's hook ignores the placeholder ``.grad``. ``deterministic`` fixes the order of each row's sum.
    """
    return _EmbeddingWithGradAccumulation.apply(ids, weight, deterministic)
