"""Forward-backward schedules over microbatches (Megatron-Core's ``pipeline_parallel.schedules``).

``get_forward_backward_func()`` picks one of three functions that share one keyword-only call:

- ``forward_backward_no_pipelining``: gradient accumulation over microbatches on one stage;
- ``forward_backward_pipelining_without_interleaving``: 1F1B. Stage ``r`` of ``p`` runs
  ``min(p - r - 1, M)`` warm-up forwards, then alternates one forward and one backward, then
  drains the remaining backwards;
- ``forward_backward_pipelining_with_interleaving``: 1F1B over virtual stages (see
  ``interleaved_schedule``).

Each returns the list of what ``loss_func`` logged per microbatch on the last stage, ``[]`` on
the other stages, and (unless ``forward_only``) leaves the accumulated gradients in the model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any

from megatron_core import parallel_state
from megatron_core._activation_offload.interface import (
    FineGrainedActivationOffloadingInterface as off_interface,
)
from megatron_core._ground import get_pg_size
from megatron_core._wrapped_model import get_attr_wrapped_model, get_model_config
from megatron_core.pipeline_parallel import hybrid_cp_schedule as _hybrid_cp_schedule
from megatron_core.pipeline_parallel.combined_1f1b import combined_1f1b_schedule_for_no_pipelining
from megatron_core.pipeline_parallel.hybrid_cp_schedule import hybrid_context_parallel_forward_backward
from megatron_core.pipeline_parallel.interleaved_schedule import (
    forward_backward_pipelining_with_interleaving,
    get_schedule_table,
)
from megatron_core.pipeline_parallel.microbatch_step import (
    GradSyncSwitch,
    add_token_count,
    backward_step,
    backward_step_multimodule,
    check_first_val_step,
    context_parallel_size,
    custom_backward,
    deallocate_output_tensor,
    finalize_model_grads_if_set,
    forward_step,
    forward_step_calc_loss,
    get_tensor_shapes,
    new_token_counter,
    resolve_communicator,
)
from megatron_core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator
from megatron_core.pipeline_parallel.p2p_communication import Shape as Shape
from megatron_core.pipeline_parallel.schedule_helpers import (
    clear_embedding_activation_buffer,
    finish_embedding_wgrad_compute,
    get_pp_rank_microbatches,
    get_tensor_device,
)
from megatron_core.process_groups_config import MultiModuleProcessGroupCollection, resolve_process_group

__all__ = [
    "Shape",
    "backward_step",
    "backward_step_multimodule",
    "check_first_val_step",
    "clear_embedding_activation_buffer",
    "custom_backward",
    "deallocate_output_tensor",
    "finish_embedding_wgrad_compute",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "forward_step",
    "forward_step_calc_loss",
    "get_attr_wrapped_model",
    "get_forward_backward_func",
    "get_model_config",
    "get_pp_rank_microbatches",
    "get_schedule_table",
    "get_tensor_device",
    "get_tensor_shapes",
]


def get_forward_backward_func(
    pp_size: int | None = None, vp_size: int | None = None, schedule_pg_collection: Any = None
) -> Callable[..., list]:
    """The schedule for this pipeline: interleaved if ``vp_size`` is set, 1F1B if ``pp_size > 1``, else none.

    Sizes left ``None`` come from ``schedule_pg_collection.pp`` or ``parallel_state``.
    """
    if pp_size is None:
        pp_size = get_pg_size(resolve_process_group("pp", schedule_pg_collection))
    if vp_size is None and schedule_pg_collection is None:
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pp_size > 1:
        if vp_size is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def _single_chunk(model: Any, data_iterator: Any, schedule: str) -> tuple[Any, Any]:
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError(f"{schedule} takes one model chunk, got {len(model)}; use the interleaved schedule")
        model = model[0]
    if isinstance(data_iterator, list):
        if len(data_iterator) != 1:
            raise ValueError(f"{schedule} takes one data iterator, got {len(data_iterator)}")
        data_iterator = data_iterator[0]
    return model, data_iterator


def _start_timer(config: Any) -> None:
    if getattr(config, "timers", None) is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)


def _stop_timer(config: Any) -> None:
    if getattr(config, "timers", None) is not None:
        config.timers("forward-backward").stop()


def forward_backward_no_pipelining(
    *,
    forward_step_func: Callable,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: Any = None,
    pg_collection: Any = None,
    force_all_reduce: bool = False,
) -> list:
    """Run ``num_microbatches`` forward (and backward) passes on the whole model, accumulating gradients.

    Gradient reduction is held back (``config.no_sync_func``) for all but the last microbatch. With
    ``config.overlap_moe_expert_parallel_comm`` (training) the combined 1F1B schedule runs instead
    (``combined_1f1b``): the forward step is then called with ``return_schedule_plan=True``. With
    ``config.hybrid_context_parallel`` the hybrid CP schedule runs the scheduled sub-samples
    (``hybrid_cp_schedule``; ``num_microbatches`` only scales the loss there).
    ``seq_length``, ``micro_batch_size`` and ``adjust_tensor_shapes_fn`` are unused (nothing is sent).
    """
    model, data_iterator = _single_chunk(model, data_iterator, "forward_backward_no_pipelining")
    config = get_model_config(model)
    _start_timer(config)
    cp_size = context_parallel_size(pg_collection)
    forward_data_store: list = []
    total_num_tokens = new_token_counter()
    sync = GradSyncSwitch(getattr(config, "no_sync_func", None))

    def run(microbatch: int) -> None:
        output_tensor, num_tokens = forward_step(
            forward_step_func, data_iterator, model, num_microbatches, None, forward_data_store, config,
            collect_non_loss_data, None,
            check_first_val_step(first_val_step, forward_only, microbatch == 0),
            current_microbatch=microbatch, is_last_stage=True, cp_size=cp_size,
        )
        add_token_count(total_num_tokens, num_tokens)
        if not forward_only:
            backward_step(None, output_tensor, None, None, config)

    if getattr(config, "overlap_moe_expert_parallel_comm", False) and not forward_only:
        combined_1f1b_schedule_for_no_pipelining(
            forward_step_func, data_iterator, model, num_microbatches, None, None, forward_data_store, config,
            collect_non_loss_data, first_val_step, forward_only, sync.context, total_num_tokens,
            partial(check_first_val_step, first_val_step, forward_only), cp_size=cp_size)
    elif getattr(config, "hybrid_context_parallel", False):
        hybrid_context_parallel_forward_backward(
            forward_step_func, data_iterator, model, num_microbatches, None, None, forward_data_store, config,
            collect_non_loss_data, first_val_step, forward_only, sync.context, total_num_tokens,
            check_first_val_step, None)
    else:
        sync.disable()
        for microbatch in range(num_microbatches - 1):
            run(microbatch)
        sync.enable()
        run(num_microbatches - 1)

    if not forward_only:
        finalize_model_grads_if_set(config, [model], total_num_tokens, pg_collection, force_all_reduce)
    if getattr(config, "fine_grained_activation_offloading", False):
        off_interface.reset()
    _stop_timer(config)
    return forward_data_store


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func: Callable,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: int | None = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: bool | None = None,
    adjust_tensor_shapes_fn: Callable | None = None,
    p2p_communicator: Any = None,
    pg_collection: Any = None,
    force_all_reduce: bool = False,
) -> list:
    """The 1F1B schedule: warm-up forwards, alternating forward/backward, then the remaining backwards.

    Multi-module pipelines (an encoder's ranks feeding a language model's, Megatron-Core 0.19): pass a
    ``MultiModulePipelineCommunicator`` and a ``MultiModuleProcessGroupCollection``; stages then exchange
    dicts of tensors keyed by module, shapes are negotiated (``config.variable_seq_lengths=True``), the
    loss is scaled by the language model's CP size and ``backward_step_multimodule`` runs the backward.
    """
    model, data_iterator = _single_chunk(model, data_iterator, "forward_backward_pipelining_without_interleaving")
    config = get_model_config(model)
    if getattr(config, "overlap_p2p_comm", False):
        raise ValueError("overlap_p2p_comm=True needs the interleaved schedule (virtual_pipeline_model_parallel_size)")
    multimodule = _check_multimodule(config, p2p_communicator, pg_collection)
    _start_timer(config)
    comm = resolve_communicator(config, p2p_communicator, pg_collection)
    is_first, is_last = comm.is_pp_first_stage, comm.is_pp_last_stage
    embedding_module = clear_embedding_activation_buffer(config, model, is_last)
    if multimodule:
        cp_size = pg_collection.get_language_model_cp_size() if pg_collection.has_language_model() else 1
        tp_group = None
        backward = partial(backward_step_multimodule,
                           language_model_module_name=pg_collection.language_model_module_name)
        recv_shapes: Any = None  # the communicator negotiates every shape
    else:
        cp_size = context_parallel_size(pg_collection)
        tp_group = resolve_process_group("tp", pg_collection)
        backward = backward_step
        recv_shapes = get_tensor_shapes(
            seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
            config=config, tp_group=tp_group, cp_group=resolve_process_group("cp", pg_collection),
        )
    sync = GradSyncSwitch(getattr(config, "no_sync_func", None))
    grad_sync_func = getattr(config, "grad_sync_func", None)
    sync.disable()

    num_warmup = min(comm.total_stages - comm.current_stage - 1, num_microbatches)
    num_remaining = num_microbatches - num_warmup
    send_shapes = list(recv_shapes) if recv_shapes is not None else None
    if adjust_tensor_shapes_fn is not None:
        recv_shapes, send_shapes = adjust_tensor_shapes_fn(recv_shapes, send_shapes)

    saved: list[tuple[Any, Any]] = []
    forward_data_store: list = []
    total_num_tokens = new_token_counter()

    def forward(input_tensor: Any, microbatch: int, is_first_microbatch: bool) -> Any:
        output_tensor, num_tokens = forward_step(
            forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store, config,
            collect_non_loss_data, None, check_first_val_step(first_val_step, forward_only, is_first_microbatch),
            current_microbatch=microbatch, is_last_stage=is_last, cp_size=cp_size,
        )
        add_token_count(total_num_tokens, num_tokens)
        return output_tensor

    def release(output_tensor: Any) -> None:
        if is_last:
            return
        if isinstance(output_tensor, dict):
            for tensor in output_tensor.values():
                deallocate_output_tensor(tensor[0] if isinstance(tensor, list) else tensor,
                                         config.deallocate_pipeline_outputs)
        else:
            deallocate_output_tensor(output_tensor[0], config.deallocate_pipeline_outputs)

    for i in range(num_warmup):
        input_tensor = comm.recv_forward(recv_shapes, is_first)
        output_tensor = forward(input_tensor, i, i == 0)
        comm.send_forward(output_tensor, is_last)
        if not forward_only:
            saved.append((input_tensor, output_tensor))
            release(output_tensor)

    input_tensor = comm.recv_forward(recv_shapes, is_first) if num_remaining > 0 else None
    for i in range(num_remaining):
        last_iteration = i == num_remaining - 1
        output_tensor = forward(input_tensor, i + num_warmup, i == 0 and num_warmup == 0)
        if forward_only:
            comm.send_forward(output_tensor, is_last)
            if not last_iteration:
                input_tensor = comm.recv_forward(recv_shapes, is_first)
            continue
        output_tensor_grad = comm.send_forward_recv_backward(output_tensor, send_shapes, is_last)
        saved.append((input_tensor, output_tensor))
        release(output_tensor)
        input_tensor, output_tensor = saved.pop(0)
        if num_warmup == 0 and last_iteration and (grad_sync_func is None or is_first):
            sync.enable()
        input_tensor_grad = backward(input_tensor, output_tensor, output_tensor_grad, config=config)
        if last_iteration:
            input_tensor = None
            comm.send_backward(input_tensor_grad, is_first)
        else:
            input_tensor = comm.send_backward_recv_forward(input_tensor_grad, recv_shapes, is_first)

    if not forward_only:
        for i in range(num_warmup):
            if i == num_warmup - 1 and (grad_sync_func is None or is_first):
                sync.enable()
            input_tensor, output_tensor = saved.pop(0)
            output_tensor_grad = comm.recv_backward(send_shapes, is_last)
            input_tensor_grad = backward(input_tensor, output_tensor, output_tensor_grad, config=config)
            comm.send_backward(input_tensor_grad, is_first)
        if sync.disabled:
            sync.enable()
            if grad_sync_func is not None:
                grad_sync_func(model.parameters())
        finish_embedding_wgrad_compute(config, embedding_module, is_last, tp_group)
        finalize_model_grads_if_set(config, [model], total_num_tokens, pg_collection, force_all_reduce)
    else:
        sync.enable()
    if getattr(config, "fine_grained_activation_offloading", False):
        off_interface.reset()
    _stop_timer(config)
    return forward_data_store


def _check_multimodule(config: Any, p2p_communicator: Any, pg_collection: Any) -> bool:
    """Whether the 1F1B call is a multi-module pipeline; raises if its arguments do not fit one."""
    multimodule = isinstance(pg_collection, MultiModuleProcessGroupCollection) or isinstance(
        p2p_communicator, MultiModulePipelineCommunicator)
    if not multimodule:
        return False
    if not isinstance(p2p_communicator, MultiModulePipelineCommunicator) or not isinstance(
            pg_collection, MultiModuleProcessGroupCollection):
        raise ValueError(
            "a multi-module pipeline needs both p2p_communicator (a MultiModulePipelineCommunicator) and "
            f"pg_collection (a MultiModuleProcessGroupCollection); got {type(p2p_communicator).__name__} and "
            f"{type(pg_collection).__name__}")
    if not getattr(config, "variable_seq_lengths", False):
        raise ValueError("a multi-module pipeline needs config.variable_seq_lengths=True (the stages exchange "
                         "tensors whose shapes differ by module); got variable_seq_lengths=False")
    return True


# The hybrid CP schedule runs this module's forward_step / backward_step (patchable here, as in Megatron-Core).
_hybrid_cp_schedule._set_step_functions(sys.modules[__name__])
