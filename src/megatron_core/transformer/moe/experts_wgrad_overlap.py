"""``overlap_dispatch_backward_with_experts_wgrad``: the routed experts' weight gradients run while the dispatch
all-to-all's backward is in flight (Megatron-Core's ``_RecordExpertDgradCompletion`` /
``_RegisterDelayedWgradForExperts``), in the ordinary backward, without the combined 1F1B schedule.

The experts defer their weight-gradient GEMMs (``tensor_parallel.delayed_wgrad``). Two identity autograd nodes
bracket the dispatch: the one after it (before the experts) marks, in the backward, that the experts' input
gradients are done; the one before it runs ``MoELayer.backward_dw(routed_experts=True)`` once the all-to-all's
backward has been issued. On CUDA the GEMMs run on a side stream that waits only for the experts' input gradients,
so they overlap the all-to-all, and the backward stream then waits for them; on a CPU they run in line.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["mark_experts_dgrad_done", "run_experts_wgrad_after_dispatch_backward"]


def _side_stream(moe_layer: Any, tensor: torch.Tensor) -> tuple[Any, Any]:
    """``(event, stream)`` of ``moe_layer``'s weight-gradient side stream on CUDA (made once); None on a CPU."""
    if not tensor.is_cuda:
        return None, None
    if getattr(moe_layer, "_delayed_wgrad_stream", None) is None:
        moe_layer._delayed_wgrad_event = torch.cuda.Event()
        moe_layer._delayed_wgrad_stream = torch.cuda.Stream(device=tensor.device)
    return moe_layer._delayed_wgrad_event, moe_layer._delayed_wgrad_stream


class _MarkExpertsDgradDone(torch.autograd.Function):
    """Identity; its backward records the side stream's event once the experts' input gradients are issued."""

    @staticmethod
    def forward(ctx, moe_layer, hidden_states):
        ctx.moe_layer = moe_layer
        return hidden_states.view_as(hidden_states)

    @staticmethod
    def backward(ctx, grad):
        event, _ = _side_stream(ctx.moe_layer, grad)
        if event is not None:
            event.record(torch.cuda.current_stream())
        ctx.moe_layer = None
        return None, grad


class _RunExpertsWgrad(torch.autograd.Function):
    """Identity; its backward (after the dispatch all-to-all's) runs the routed experts' deferred wgrad."""

    @staticmethod
    def forward(ctx, moe_layer, hidden_states):
        ctx.moe_layer = moe_layer
        return hidden_states.view_as(hidden_states)

    @staticmethod
    def backward(ctx, grad):
        moe_layer, ctx.moe_layer = ctx.moe_layer, None
        event, stream = _side_stream(moe_layer, grad)
        if stream is None:
            moe_layer.backward_dw(routed_experts=True, shared_experts=False)
            return None, grad
        stream.wait_event(event)
        with torch.cuda.stream(stream):
            moe_layer.backward_dw(routed_experts=True, shared_experts=False)
            event.record(stream)
        torch.cuda.current_stream().wait_event(event)
        return None, grad


def mark_experts_dgrad_done(moe_layer: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """``hidden_states`` (the dispatched tokens, before the experts) through the node that marks, in the backward,
    the end of the experts' input gradients."""
    return _MarkExpertsDgradDone.apply(moe_layer, hidden_states)


def run_experts_wgrad_after_dispatch_backward(moe_layer: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """``hidden_states`` (the tokens before the dispatch) through the node whose backward runs the experts'
    deferred weight gradients."""
    return _RunExpertsWgrad.apply(moe_layer, hidden_states)
