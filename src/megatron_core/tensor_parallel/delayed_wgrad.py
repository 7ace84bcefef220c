"""Weight gradients split out of the backward (Megatron-Core's ``delay_wgrad_compute``, Transformer Engine's split
wgrad): the linear's backward returns only the input (and bias) gradient and queues its weight-gradient GEMM;
the layer's ``backward_dw()`` runs the queue later.

A layer opts in with :meth:`DelayedWgradMixin.enable_delayed_wgrad` (``TransformerLayer`` does it for its
attention and MLP when ``config.delay_wgrad_compute`` is set; ``MoELayer`` for its routed experts under
``overlap_dispatch_backward_with_experts_wgrad``). Its weight is then marked ``skip_backward_post_hook``: autograd
never produces a gradient for it, so DDP registers its grad-ready hook with
:meth:`DelayedWgradMixin.register_wgrad_accumulation_and_reduce_hooks` instead of on the parameter, and
``backward_dw()`` fires it once the GEMMs have landed (in ``weight.main_grad`` with ``gradient_accumulation_fusion``,
else in ``weight.grad``). The GEMMs are those of the immediate backward on the same tensors, so the gradients are
identical; a queued GEMM keeps its saved activations alive until ``backward_dw()`` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core.tensor_parallel.linear_function import (
    LinearWithGradAccumulationAndAsyncCommunication,
    _flatten_tokens,
)
from megatron_core.tensor_parallel.mappings import _gather_along_first_dim
from megatron_core.tensor_parallel.wgrad_accumulation import accumulate_weight_gradient

__all__ = ["DelayedWgradMixin", "LinearWithDelayedWgrad", "add_weight_gradient", "enable_delayed_wgrad",
           "pending_delayed_wgrads", "run_delayed_wgrads", "split_weight_gradient"]


def add_weight_gradient(weight: torch.Tensor, grad_weight: torch.Tensor) -> None:
    """Add a finished weight gradient to ``weight.grad`` the way autograd's accumulation would."""
    grad_weight = grad_weight.to(weight.dtype)
    if weight.grad is None:
        weight.grad = grad_weight
    else:
        weight.grad.add_(grad_weight)


class DelayedWgradMixin:
    """The ``backward_dw`` protocol of a layer whose weight-gradient GEMMs can be deferred.

    Off by default: ``backward_dw()`` is then a no-op and the backward computes the weight gradient as usual.
    """

    delay_wgrad_compute: bool = False

    def deferrable(self) -> bool:
        """Whether this layer can defer its weight gradient (a subclass with its own GEMM may not)."""
        return True

    def enable_delayed_wgrad(self) -> None:
        """Defer this layer's weight gradient from now on (call before DDP wraps the model)."""
        self.delay_wgrad_compute = True
        self._wgrad_queue: list[Callable[[], None]] = []
        self._wgrad_hooks: list[Callable[[], None]] = []
        weight = getattr(self, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            weight.skip_backward_post_hook = True

    def queue_wgrad(self, compute: Callable[[], None]) -> None:
        """Queue one weight-gradient computation (called by the backward)."""
        self._wgrad_queue.append(compute)

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """Run ``hook()`` after each ``backward_dw()`` that computed a weight gradient (DDP's grad-ready hook)."""
        if not self.delay_wgrad_compute:
            raise ValueError(f"{type(self).__name__}: register_wgrad_accumulation_and_reduce_hooks needs "
                             "delay_wgrad_compute (enable_delayed_wgrad() first)")
        self._wgrad_hooks.append(hook)

    def pending_wgrads(self) -> int:
        """How many queued weight-gradient GEMMs wait for ``backward_dw()``."""
        return len(self._wgrad_queue) if self.delay_wgrad_compute else 0

    def backward_dw(self) -> None:
        """Run the queued weight-gradient GEMMs (oldest first), then the registered hooks; no-op when none."""
        if not self.delay_wgrad_compute or not self._wgrad_queue:
            return
        queue, self._wgrad_queue = self._wgrad_queue, []
        with torch.no_grad():
            for compute in queue:
                compute()
        for hook in self._wgrad_hooks:
            hook()


def enable_delayed_wgrad(module: torch.nn.Module) -> None:
    """Defer the weight gradients of every deferrable layer inside ``module`` (``module`` included)."""
    for sub in module.modules():
        if isinstance(sub, DelayedWgradMixin) and sub.deferrable():
            sub.enable_delayed_wgrad()


def run_delayed_wgrads(module: torch.nn.Module) -> None:
    """``backward_dw()`` of every deferring layer inside ``module``, last layer first (the backward's order)."""
    for sub in reversed(list(module.modules())):
        if isinstance(sub, DelayedWgradMixin):
            sub.backward_dw()


def pending_delayed_wgrads(module: torch.nn.Module) -> int:
    """How many weight-gradient GEMMs inside ``module`` wait for ``backward_dw()``."""
    return sum(sub.pending_wgrads() for sub in module.modules() if isinstance(sub, DelayedWgradMixin))


def _linear_weight_gradient(weight: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor,
                            sequence_parallel: bool, tp_group: Any, fused: bool) -> None:
    """``dW = dY^T X`` for the parallel linear op, into ``main_grad`` (fusion) or ``.grad``."""
    total_input = _gather_along_first_dim(input, tp_group) if sequence_parallel else input
    grad_output_2d, input_2d = _flatten_tokens(grad_output), _flatten_tokens(total_input)
    if fused and hasattr(weight, "main_grad"):
        accumulate_weight_gradient(weight.main_grad, grad_output_2d, input_2d)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
        return
    add_weight_gradient(weight, grad_output_2d.t().matmul(input_2d))


class LinearWithDelayedWgrad(LinearWithGradAccumulationAndAsyncCommunication):
    """The parallel linear op whose backward queues the weight gradient on ``layer`` instead of returning it.

    The input gradient and its TP communication, and the bias gradient, are those of the immediate op.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                tp_group, layer):
        ctx.layer = layer
        return LinearWithGradAccumulationAndAsyncCommunication.forward(
            ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, None, 0,
            tp_group)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        weight_requires_grad, ctx.weight_requires_grad = ctx.weight_requires_grad, False
        grad_input, _, grad_bias = LinearWithGradAccumulationAndAsyncCommunication.backward(ctx, grad_output)[:3]
        if weight_requires_grad:
            sequence_parallel, tp_group, fused = ctx.sequence_parallel, ctx.tp_group, ctx.gradient_accumulation_fusion
            ctx.layer.queue_wgrad(lambda: _linear_weight_gradient(weight, grad_output, input, sequence_parallel,
                                                                  tp_group, fused))
        ctx.layer = None
        return grad_input, None, grad_bias, None, None, None, None, None


class _SplitWeightGradient(torch.autograd.Function):
    """``compute(x, weight)`` whose backward returns only ``x``'s gradient and queues ``weight``'s on ``layer``.

    The forward records ``compute`` on detached leaves; the backward differentiates that graph twice, for the
    input now and for the weight in ``backward_dw()``, with the same kernels as one combined backward.
    """

    @staticmethod
    def forward(ctx, compute, layer, x, weight):
        with torch.enable_grad():
            x_leaf = x.detach().requires_grad_(x.requires_grad)
            weight_leaf = weight.detach().requires_grad_(True)
            out = compute(x_leaf, weight_leaf)
        ctx.graph = (x_leaf, weight_leaf, out)
        ctx.layer = layer
        ctx.weight = weight
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        x_leaf, weight_leaf, out = ctx.graph
        weight, layer = ctx.weight, ctx.layer
        ctx.graph = ctx.layer = ctx.weight = None
        grad_x = None
        if x_leaf.requires_grad:
            (grad_x,) = torch.autograd.grad(out, x_leaf, grad, retain_graph=True)

        def weight_gradient() -> None:
            with torch.enable_grad():
                (grad_weight,) = torch.autograd.grad(out, weight_leaf, grad)
            fused = getattr(layer.config, "gradient_accumulation_fusion", False)
            if fused and hasattr(weight, "main_grad"):
                weight.main_grad.add_(grad_weight)
                if hasattr(weight, "grad_added_to_main_grad"):
                    weight.grad_added_to_main_grad = True
            else:
                add_weight_gradient(weight, grad_weight)

        layer.queue_wgrad(weight_gradient)
        return None, None, grad_x, None


def split_weight_gradient(compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], layer: DelayedWgradMixin,
                          x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``compute(x, weight)`` with ``weight``'s gradient deferred to ``layer.backward_dw()`` (any differentiable
    ``compute``: the grouped expert GEMMs)."""
    return _SplitWeightGradient.apply(compute, layer, x, weight)
