"""The combined 1F1B schedule of ``overlap_moe_expert_parallel_comm`` (Megatron-Core's ``pipeline_parallel.combined_1f1b``).

Each step runs one micro-batch's forward together with another micro-batch's backward, node by node
(see ``models.common.model_chunk_schedule_plan``), so that on CUDA one's MoE all-to-alls (on a
communication stream) overlap the other's attention and expert computation. Without pipelining and
``M`` micro-batches: forward 0; then forward ``i + 1`` with backward ``i``; then backward ``M - 1``.
The interleaved pipeline schedule calls :func:`combined_1f1b_schedule_for_interleaved_pipelining` for
each of its steps (and runs one extra warm-up forward so that no step pairs a micro-batch with itself).

The model's forward step must accept ``return_schedule_plan=True`` and then return
``(model.build_schedule_plan(...), loss_func)`` instead of ``(model(...), loss_func)``. The output of a
forward step carries its plan and loss node (``output.schedule_plan``, ``output.loss_func``) until its
backward.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from megatron_core import device
from megatron_core._wrapped_model import get_attr_wrapped_model
from megatron_core.pipeline_parallel.microbatch_step import add_token_count, forward_step_calc_loss
from megatron_core.pipeline_parallel.p2p_communication import Shape as Shape
from megatron_core.pipeline_parallel.schedule_node import (
    AbstractSchedulePlan,
    ScheduleNode,
    get_comp_stream,
    set_streams,
)

__all__ = [
    "Shape",
    "combined_1f1b_schedule_for_interleaved_pipelining",
    "combined_1f1b_schedule_for_no_pipelining",
    "combined_forward_backward_step",
]


def combined_1f1b_schedule_for_no_pipelining(
    forward_step_func: Callable, data_iterator: Any, model: torch.nn.Module, num_microbatches: int,
    input_tensor: Any, output_tensor_grad: Any, forward_data_store: list, config: Any, collect_non_loss_data: bool,
    first_val_step: bool | None, forward_only: bool, no_sync_func: Callable, total_num_tokens: torch.Tensor,
    check_first_val_step: Callable[[bool], bool], *, cp_size: int = 1,
) -> tuple[list, torch.Tensor]:
    """All micro-batches on one stage: forward 0, then (forward ``i + 1``, backward ``i``) pairs, then backward
    ``M - 1``; gradient reduction is held back (``no_sync_func``) until the last backward.

    Returns ``(forward_data_store, total_num_tokens)``.
    """
    set_streams(high_priority=getattr(config, "high_priority_a2a_comm_stream", False))

    def step(f_model: Any, b_model: Any, b_output: Any, microbatch: int | None) -> tuple[Any, torch.Tensor]:
        output, num_tokens, _ = combined_forward_backward_step(
            forward_step_func, data_iterator, f_model, num_microbatches, input_tensor, forward_data_store, b_model,
            input_tensor, b_output, output_tensor_grad, config, collect_non_loss_data=collect_non_loss_data,
            is_first_microbatch=check_first_val_step(microbatch == 0), current_microbatch=microbatch,
            is_last_stage=True, cp_group_size=cp_size)
        if num_tokens is not None:
            add_token_count(total_num_tokens, num_tokens)
        return output

    output = step(model, None, None, 0)
    with no_sync_func():
        for microbatch in range(1, num_microbatches):
            output = step(model, model, output, microbatch)
    step(None, model, output, None)
    return forward_data_store, total_num_tokens


def combined_1f1b_schedule_for_interleaved_pipelining(
    config: Any, forward_step_func: Callable, data_iterator: list, model: list, num_microbatches: int,
    forward_data_store: list, forward_step_helper_preprocess: Callable, forward_step_helper_postprocess: Callable,
    backward_step_helper_preprocess: Callable, backward_step_helper_postprocess: Callable,
    get_microbatch_id_in_model_chunk: Callable, get_model_chunk_id: Callable, check_first_val_step: Callable,
    is_first_microbatch_for_model_chunk: Callable, collect_non_loss_data: bool,
    f_virtual_microbatch_id: int | None = None, b_virtual_microbatch_id: int | None = None,
    pre_forward: Callable | None = None, pre_backward: Callable | None = None,
    post_forward: Callable | None = None, post_backward: Callable | None = None,
    *, is_last_stage: Callable[[int], bool] | None = None, cp_size: int = 1,
) -> tuple[Any, Any]:
    """One step of the interleaved schedule: forward virtual micro-batch ``f_virtual_microbatch_id`` and backward
    ``b_virtual_microbatch_id`` (either may be None) through :func:`combined_forward_backward_step`, between the
    schedule's own pre- and post-processing of each (queues, gradient-sync switches).

    ``is_last_stage(chunk)`` says whether ``chunk`` computes the loss on this rank. Returns
    ``(output_tensor, input_tensor_grad)``.
    """
    set_streams(high_priority=getattr(config, "high_priority_a2a_comm_stream", False))
    f_chunk = f_microbatch = input_tensor = None
    if f_virtual_microbatch_id is not None:
        f_microbatch = get_microbatch_id_in_model_chunk(f_virtual_microbatch_id, forward=True)
        f_chunk = get_model_chunk_id(f_virtual_microbatch_id, forward=True)
        input_tensor = forward_step_helper_preprocess(f_virtual_microbatch_id, f_chunk, f_microbatch)
    b_chunk = b_input_tensor = b_output_tensor = b_output_tensor_grad = None
    if b_virtual_microbatch_id is not None:
        b_chunk = get_model_chunk_id(b_virtual_microbatch_id, forward=False)
        b_input_tensor, b_output_tensor, b_output_tensor_grad = backward_step_helper_preprocess(
            b_virtual_microbatch_id, b_chunk)
    output_tensor, num_tokens, input_tensor_grad = combined_forward_backward_step(
        forward_step_func,
        data_iterator[f_chunk] if f_chunk is not None else None,
        model[f_chunk] if f_chunk is not None else None,
        num_microbatches, input_tensor, forward_data_store,
        model[b_chunk] if b_chunk is not None else None,
        b_input_tensor, b_output_tensor, b_output_tensor_grad, config,
        f_model_chunk_id=f_chunk, pre_forward=pre_forward, pre_backward=pre_backward, post_forward=post_forward,
        post_backward=post_backward, collect_non_loss_data=collect_non_loss_data,
        is_first_microbatch=(f_virtual_microbatch_id is not None
                             and check_first_val_step(is_first_microbatch_for_model_chunk(f_virtual_microbatch_id))),
        current_microbatch=f_microbatch,
        is_last_stage=(is_last_stage(f_chunk) if is_last_stage is not None and f_chunk is not None else None),
        cp_group_size=cp_size,
    )
    if f_chunk is not None:
        forward_step_helper_postprocess(f_chunk, output_tensor, num_tokens)
    if b_chunk is not None:
        backward_step_helper_postprocess(b_virtual_microbatch_id)
        if b_input_tensor is not None and input_tensor_grad is None:
            raise RuntimeError(f"combined 1F1B: the backward of virtual micro-batch {b_virtual_microbatch_id} "
                               "produced no gradient for its received input")
    return output_tensor, input_tensor_grad


def combined_forward_backward_step(
    forward_step_func: Callable, data_iterator: Any, f_model: Any, num_microbatches: int, input_tensor: Any,
    forward_data_store: list, b_model: Any, b_input_tensor: Any, b_output_tensor: Any, b_output_tensor_grad: Any,
    config: Any, f_model_chunk_id: int | None = None, pre_forward: Callable | None = None,
    pre_backward: Callable | None = None, post_forward: Callable | None = None,
    post_backward: Callable | None = None, collect_non_loss_data: bool = False,
    checkpoint_activations_microbatch: bool | None = None, is_first_microbatch: bool = False,
    current_microbatch: int | None = None, encoder_decoder_xattn: bool = False, *,
    is_last_stage: bool | None = None, cp_group_size: int | None = None,
) -> tuple[Any, torch.Tensor | None, Any]:
    """``forward_step`` on ``f_model`` and ``backward_step`` on ``b_model`` merged: the forward micro-batch's plan
    is built, then run interleaved with the backward micro-batch's plan (taken from ``b_output_tensor``).

    ``is_last_stage`` / ``cp_group_size`` go to ``forward_step_calc_loss`` (``parallel_state``'s when None).
    Returns ``(output_tensor, num_tokens, input_tensor_grad)``; ``num_tokens`` is None without a forward.
    """
    if checkpoint_activations_microbatch is not None:
        raise ValueError("checkpoint_activations_microbatch is not supported with overlap_moe_expert_parallel_comm")
    if encoder_decoder_xattn:
        raise ValueError("encoder-decoder cross-attention is not supported with overlap_moe_expert_parallel_comm")
    timers = getattr(config, "timers", None)
    if f_model is not None and timers is not None:
        timers("forward-compute", log_level=2).start()
    autocast = (torch.autocast(device.get_current_device().type, dtype=config.autocast_dtype)
                if getattr(config, "enable_autocast", False) else contextlib.nullcontext())

    f_schedule_plan = loss_func = None
    unwrap_output = False
    if f_model is not None:
        if is_first_microbatch:
            _call_if_present(f_model, "set_is_first_microbatch")
        unwrap_output = not isinstance(input_tensor, list)
        get_attr_wrapped_model(f_model, "set_input_tensor")([input_tensor] if unwrap_output else input_tensor)
        _check_accepts_schedule_plan(forward_step_func)
        with autocast:
            unwrapped = get_attr_wrapped_model(f_model, "build_schedule_plan", return_model_obj=True)
            f_schedule_plan, loss_func = forward_step_func(data_iterator, unwrapped, return_schedule_plan=True)
        if not isinstance(f_schedule_plan, AbstractSchedulePlan):
            raise TypeError("with overlap_moe_expert_parallel_comm the forward step must return "
                            "(model.build_schedule_plan(...), loss_func) when called with return_schedule_plan=True; "
                            f"got {type(f_schedule_plan).__name__}")

    b_schedule_plan = b_grad = None
    unwrap_input_grad = False
    if b_model is not None:
        unwrap_input_grad = not isinstance(b_input_tensor, list)
        b_inputs = [b_input_tensor] if unwrap_input_grad else list(b_input_tensor)
        for tensor in b_inputs:
            if tensor is not None:
                tensor.retain_grad()
        b_outputs = b_output_tensor if isinstance(b_output_tensor, list) else [b_output_tensor]
        b_grads = list(b_output_tensor_grad) if isinstance(b_output_tensor_grad, list) else [b_output_tensor_grad]
        b_schedule_plan, b_outputs[0].schedule_plan = b_outputs[0].schedule_plan, None
        loss_node, b_outputs[0].loss_func = b_outputs[0].loss_func, None
        if b_grads[0] is None:  # the last stage: backpropagate the loss into the loss node's input
            loss = b_outputs[0]
            if getattr(config, "grad_scale_func", None) is not None:
                loss = config.grad_scale_func(loss)
            torch.autograd.backward(loss)
            b_grads[0] = loss_node.get_grad()
            loss_node._release_state()
        b_grad = b_grads[0]

    with autocast:
        output_tensor = type(f_schedule_plan or b_schedule_plan).run(
            f_schedule_plan, b_schedule_plan, b_grad=b_grad, pre_forward=pre_forward, pre_backward=pre_backward,
            post_forward=post_forward, post_backward=post_backward)

    num_tokens = None
    if f_model is not None:
        stream = get_comp_stream if f_schedule_plan.event is not None else None
        loss_node = ScheduleNode(loss_func, stream, f_schedule_plan.event, name="loss_func")
        output_tensor, num_tokens = forward_step_calc_loss(
            f_model, output_tensor, loss_node.forward, config, f_model_chunk_id, collect_non_loss_data,
            num_microbatches, forward_data_store, cp_group_size=cp_group_size, is_last_stage=is_last_stage)
        output_tensor.schedule_plan = f_schedule_plan
        output_tensor.loss_func = loss_node
        if not unwrap_output:
            output_tensor = [output_tensor]

    input_tensor_grad = None
    if b_model is not None:
        input_tensor_grad = [None if tensor is None else tensor.grad for tensor in b_inputs]
        if unwrap_input_grad:
            input_tensor_grad = input_tensor_grad[0]
    return output_tensor, num_tokens, input_tensor_grad


def _check_accepts_schedule_plan(forward_step_func: Callable) -> None:
    """``TypeError`` naming the protocol when the forward step cannot take ``return_schedule_plan``."""
    try:
        params = inspect.signature(forward_step_func).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call decide
        return
    if not any(p.name == "return_schedule_plan" or p.kind is p.VAR_KEYWORD for p in params):
        raise TypeError("overlap_moe_expert_parallel_comm=True: the forward step function must accept "
                        "return_schedule_plan=True and then return (model.build_schedule_plan(...), loss_func)")


def _call_if_present(model: Any, method: str) -> None:
    try:
        func = get_attr_wrapped_model(model, method)
    except RuntimeError:
        return
    func()
