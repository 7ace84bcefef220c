"""The interleaved 1F1B schedule over virtual pipeline stages (Megatron-Core's VPP schedule).

Each pipeline rank holds ``V`` model chunks; chunk ``c`` on rank ``r`` is virtual stage
``c * p + r``, so an activation leaving the last rank's chunk ``c`` enters rank 0's chunk ``c + 1``.
All ranks walk the same table of ``(microbatch, chunk)`` forward steps, built in groups of
``N = microbatch_group_size_per_vp_stage`` (default ``p``) consecutive microbatches per chunk;
backward step ``k`` runs the same microbatch on chunk ``V - 1 - chunk``. Rank ``r`` runs
``2 (p - r - 1) + (V - 1) N`` warm-up forwards (all of them when ``M == p``), then one forward
and one backward per step, then the remaining backwards.

Surprising: rank 0 receives activations for chunk ``c + 1`` before it needs them and queues
them; every chunk keeps FIFO queues of received inputs, received output gradients and
``(input, output)`` pairs awaiting backward.

With ``config.overlap_p2p_comm`` each step's forward exchange (send the activation, receive the
next input) is posted right after its forward and waited for only before the next forward; the
backward exchange likewise around the backward. The transfers then run while the other half of
the step computes, and no exchange waits for the device (with ``batch_p2p_comm=False``, as
Megatron's training sets it, not even ``batch_p2p_sync``). An output is freed once its send is
done.

With ``config.overlap_moe_expert_parallel_comm`` (training) every step goes through the combined 1F1B
schedule (``combined_1f1b``): a step's forward and backward run interleaved node by node, and each rank
runs one more warm-up forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any

from megatron_core._activation_offload.interface import (
    FineGrainedActivationOffloadingInterface as off_interface,
)
from megatron_core._wrapped_model import get_model_config
from megatron_core.pipeline_parallel.combined_1f1b import combined_1f1b_schedule_for_interleaved_pipelining
from megatron_core.pipeline_parallel.microbatch_step import (
    GradSyncSwitch,
    add_token_count,
    backward_step,
    check_first_val_step,
    context_parallel_size,
    deallocate_output_tensor,
    finalize_model_grads_if_set,
    forward_step,
    get_tensor_shapes,
    new_token_counter,
    resolve_communicator,
)
from megatron_core.pipeline_parallel.p2p_communication import wait_handles
from megatron_core.pipeline_parallel.schedule_helpers import (
    clear_embedding_activation_buffer,
    finish_embedding_wgrad_compute,
)
from megatron_core.process_groups_config import resolve_process_group


def get_schedule_table(
    num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: int
) -> list[tuple[int, int]]:
    """The ``(microbatch, chunk)`` of every forward step, in order; the last group takes the remainder."""
    table = []
    group = microbatch_group_size_per_vp_stage
    for start in range(0, num_microbatches, group):
        end = num_microbatches if start + group >= num_microbatches else start + group
        table.extend((mb, chunk) for chunk in range(num_model_chunks) for mb in range(start, end))
    return table


def _check_sizes(num_microbatches: int, pp_size: int, group: int) -> None:
    if group < pp_size or group > num_microbatches:
        raise ValueError(
            f"the interleaved schedule needs pipeline_model_parallel_size ({pp_size}) <= "
            f"microbatch_group_size_per_vp_stage ({group}) <= num_microbatches ({num_microbatches})"
        )
    if num_microbatches % group != 0:
        raise ValueError(
            f"the interleaved schedule needs num_microbatches ({num_microbatches}) divisible by "
            f"microbatch_group_size_per_vp_stage ({group}, default pipeline_model_parallel_size ({pp_size}))"
        )


def _per_chunk(funcs: Any, num_chunks: int) -> list | None:
    if funcs is None or isinstance(funcs, list):
        return funcs
    return [funcs] * num_chunks


def _no_sync_all(no_sync_func: Any) -> Callable | None:
    """One context entering every chunk's ``no_sync`` when ``config.no_sync_func`` is a list."""
    if not isinstance(no_sync_func, list):
        return no_sync_func

    def enter_all() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for func in no_sync_func:
            stack.enter_context(func())
        return stack

    return enter_all


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func: Callable,
    data_iterator: list,
    model: list,
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
    """Interleaved 1F1B over ``len(model)`` chunks per rank; ``model`` and ``data_iterator`` are lists."""
    if not isinstance(model, list) or not isinstance(data_iterator, list):
        raise TypeError("the interleaved schedule needs a list of model chunks and a list of data iterators")
    if len(model) != len(data_iterator):
        raise ValueError(f"got {len(model)} model chunks but {len(data_iterator)} data iterators")
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("adjust_tensor_shapes_fn is not supported by the interleaved schedule")
    config = get_model_config(model[0])
    comm = resolve_communicator(config, p2p_communicator, pg_collection)
    pp_size, pp_rank = comm.total_stages, comm.current_stage
    embedding_module = clear_embedding_activation_buffer(config, list(model), comm.is_pp_last_stage)
    num_chunks = len(model)
    group = config.microbatch_group_size_per_vp_stage or pp_size
    _check_sizes(num_microbatches, pp_size, group)
    if getattr(config, "timers", None) is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

    table = get_schedule_table(num_microbatches, num_chunks, group)
    total = len(table)
    tensor_shape = get_tensor_shapes(
        seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
        config=config, tp_group=resolve_process_group("tp", pg_collection), cp_group=resolve_process_group("cp", pg_collection),
    )[0]
    cp_size = context_parallel_size(pg_collection)
    grad_sync_funcs = _per_chunk(getattr(config, "grad_sync_func", None), num_chunks)
    param_sync_funcs = _per_chunk(getattr(config, "param_sync_func", None), num_chunks)
    sync = GradSyncSwitch(_no_sync_all(getattr(config, "no_sync_func", None)))
    synchronized: set[int] = set()

    def chunk_of(k: int, forward: bool) -> int:
        chunk = table[k % total][1]
        return chunk if forward else num_chunks - 1 - chunk

    def is_first(chunk: int) -> bool:
        return pp_rank == 0 and chunk == 0

    def is_last(chunk: int) -> bool:
        return pp_rank == pp_size - 1 and chunk == num_chunks - 1

    def is_last_microbatch(k: int) -> bool:
        return 0 <= k < total and table[k][0] == num_microbatches - 1

    def receives(k: int, forward: bool) -> tuple[bool, int]:
        """Whether step ``k`` receives a tensor (in this direction) and which chunk it belongs to."""
        leading = pp_rank == 0 if forward else pp_rank == pp_size - 1
        if not leading:
            return k + 1 < total, chunk_of(k + 1, forward)
        # The leading rank runs p - 1 steps ahead of the rank on the other end of the ring.
        if k < pp_size - 1:
            return False, chunk_of(k + 1, forward)
        sender_chunk = chunk_of(k - (pp_size - 1), forward)
        if sender_chunk == (num_chunks - 1 if forward else 0):
            return False, sender_chunk
        return True, sender_chunk + (1 if forward else -1)

    inputs: list[list] = [[] for _ in range(num_chunks)]
    output_grads: list[list] = [[] for _ in range(num_chunks)]
    saved: list[list] = [[] for _ in range(num_chunks)]
    forward_data_store: list = []
    total_num_tokens = new_token_counter()

    pending_inputs: list[list] = [[] for _ in range(num_chunks)]

    def forward_preprocess(k: int, chunk: int, microbatch: int) -> Any:
        """Sync the parameters of a chunk about to start and take this step's input."""
        if param_sync_funcs is not None:
            sync_k = k + pp_rank
            if sync_k < total and table[sync_k][0] == 0:
                sync_chunk = chunk_of(sync_k, forward=True) + 1
                if 1 < sync_chunk < num_chunks:
                    param_sync_funcs[sync_chunk](model[sync_chunk].parameters())
        input_tensor = None if is_first(chunk) else inputs[chunk].pop(0)
        pending_inputs[chunk].append(input_tensor)
        return input_tensor

    def forward_postprocess(chunk: int, output_tensor: Any, num_tokens: Any) -> None:
        """Count the tokens and keep ``(input, output)`` for the backward."""
        add_token_count(total_num_tokens, num_tokens)
        input_tensor = pending_inputs[chunk].pop(0)
        if not forward_only:
            saved[chunk].append((input_tensor, output_tensor))

    def forward_helper(k: int) -> Any:
        chunk = chunk_of(k, forward=True)
        microbatch = table[k][0]
        input_tensor = forward_preprocess(k, chunk, microbatch)
        output_tensor, num_tokens = forward_step(
            forward_step_func, data_iterator[chunk], model[chunk], num_microbatches, input_tensor,
            forward_data_store, config, collect_non_loss_data, None,
            check_first_val_step(first_val_step, forward_only, microbatch == 0),
            current_microbatch=microbatch, is_last_stage=is_last(chunk), cp_size=cp_size,
        )
        forward_postprocess(chunk, output_tensor, num_tokens)
        return output_tensor

    def backward_preprocess(k: int, chunk: int) -> tuple[Any, Any, Any]:
        """Open gradient reduction for a chunk's last micro-batch; ``(input, output, output gradient)``."""
        if grad_sync_funcs is None and is_last_microbatch(k):
            sync.enable()
            synchronized.add(chunk)
        input_tensor, output_tensor = saved[chunk].pop(0)
        output_tensor_grad = None if is_last(chunk) else output_grads[chunk].pop(0)
        return input_tensor, output_tensor, output_tensor_grad

    def backward_postprocess(k: int) -> None:
        """Launch a custom gradient sync when a chunk is done, then hold reduction back again."""
        if grad_sync_funcs is not None and is_last_microbatch(k - pp_rank):
            sync_chunk = chunk_of(k - pp_rank, forward=False)
            sync.enable()
            grad_sync_funcs[sync_chunk](model[sync_chunk].parameters())
            synchronized.add(sync_chunk)
        sync.disable()

    def backward_helper(k: int) -> Any:
        chunk = chunk_of(k, forward=False)
        input_tensor_grad = backward_step(*backward_preprocess(k, chunk), None, config)
        backward_postprocess(k)
        return None if is_first(chunk) else input_tensor_grad

    combined = bool(getattr(config, "overlap_moe_expert_parallel_comm", False)) and not forward_only

    def combined_step(f_k: int | None, b_k: int | None) -> tuple[Any, Any]:
        """Forward step ``f_k`` and backward step ``b_k`` through the combined 1F1B schedule."""
        output_tensor, input_tensor_grad = combined_1f1b_schedule_for_interleaved_pipelining(
            config, forward_step_func, data_iterator, model, num_microbatches, forward_data_store,
            forward_preprocess, forward_postprocess, backward_preprocess, backward_postprocess,
            lambda k, forward: table[k % total][0], chunk_of,
            partial(check_first_val_step, first_val_step, forward_only), lambda k: table[k][0] == 0,
            collect_non_loss_data, f_virtual_microbatch_id=f_k, b_virtual_microbatch_id=b_k,
            is_last_stage=is_last, cp_size=cp_size)
        if b_k is not None and is_first(chunk_of(b_k, forward=False)):
            input_tensor_grad = None
        return output_tensor, input_tensor_grad

    def sendable(output_tensor: Any, chunk: int) -> Any:
        return None if is_last(chunk) else output_tensor

    overlap = bool(getattr(config, "overlap_p2p_comm", False))
    # overlap_p2p_comm: the posted exchange of each direction, (handles, received tensor, its chunk, sent tensor);
    # the sent tensor is held until its send is done.
    pending: dict[str, tuple | None] = {"forward": None, "backward": None}

    def post_forward(output_tensor: Any, recv_prev: bool, chunk: int) -> None:
        received, handles = comm.send_forward_recv_forward(output_tensor, recv_prev, tensor_shape,
                                                           overlap_p2p_comm=True)
        pending["forward"] = (handles, received, chunk, output_tensor)

    def post_backward(input_tensor_grad: Any, recv_next: bool, chunk: int) -> None:
        received, handles = comm.send_backward_recv_backward(input_tensor_grad, recv_next, tensor_shape,
                                                             overlap_p2p_comm=True)
        pending["backward"] = (handles, received, chunk, input_tensor_grad)

    def complete(direction: str) -> None:
        """Wait for the posted exchange of ``direction``; queue what it received, free what it sent."""
        posted = pending[direction]
        if posted is None:
            return
        pending[direction] = None
        handles, received, chunk, sent = posted
        wait_handles(handles)
        if received is not None:
            (inputs if direction == "forward" else output_grads)[chunk].append(received)
        if direction == "forward" and sent is not None:
            deallocate_output_tensor(sent, config.deallocate_pipeline_outputs)

    all_warmup = not forward_only and num_microbatches == pp_size
    if forward_only or all_warmup:
        num_warmup = total
    else:
        # The combined 1F1B schedule runs one more warm-up forward, so that no step pairs a forward with the
        # backward of the same micro-batch.
        num_warmup = min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * group + int(combined), total)
    num_remaining = total - num_warmup

    sync.disable()
    if param_sync_funcs is not None:
        for chunk in range(min(2, num_chunks)):
            param_sync_funcs[chunk](model[chunk].parameters())
    if not is_first(0):
        inputs[0].append(comm.recv_forward(tensor_shape, is_first_stage=False))

    for k in range(num_warmup):
        complete("forward")
        output_tensor = combined_step(k, None)[0] if combined else forward_helper(k)
        output_tensor = sendable(output_tensor, chunk_of(k, forward=True))
        recv_prev, next_chunk = receives(k, forward=True)
        if overlap:
            post_forward(output_tensor, recv_prev, next_chunk)
            if k == num_warmup - 1 and not forward_only and not all_warmup:
                post_backward(None, pp_rank != pp_size - 1, num_chunks - 1)
            continue
        if k == num_warmup - 1 and not forward_only and not all_warmup:
            recv_next = pp_rank != pp_size - 1
            input_tensor, output_tensor_grad = comm.send_forward_backward_recv_forward_backward(
                output_tensor, None, recv_prev, recv_next, tensor_shape
            )
            if recv_next:
                output_grads[num_chunks - 1].append(output_tensor_grad)
        else:
            input_tensor = comm.send_forward_recv_forward(output_tensor, recv_prev, tensor_shape)
        if recv_prev:
            inputs[next_chunk].append(input_tensor)
        deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)

    for step in range(num_remaining):
        forward_k = step + num_warmup
        complete("forward")
        if combined:
            complete("backward")
            output_tensor, input_tensor_grad = combined_step(forward_k, step)
        else:
            output_tensor = forward_helper(forward_k)
        output_tensor = sendable(output_tensor, chunk_of(forward_k, forward=True))
        recv_prev, next_forward_chunk = receives(forward_k, forward=True)
        if overlap:
            post_forward(output_tensor, recv_prev, next_forward_chunk)
        if not combined:
            complete("backward")
            input_tensor_grad = backward_helper(step)
        recv_next, next_backward_chunk = receives(step, forward=False)
        if overlap:
            post_backward(input_tensor_grad, recv_next, next_backward_chunk)
            continue
        input_tensor, output_tensor_grad = comm.send_forward_backward_recv_forward_backward(
            output_tensor, input_tensor_grad, recv_prev, recv_next, tensor_shape
        )
        deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)
        if recv_prev:
            inputs[next_forward_chunk].append(input_tensor)
        if recv_next:
            output_grads[next_backward_chunk].append(output_tensor_grad)

    complete("forward")
    if not forward_only:
        if all_warmup and pp_rank != pp_size - 1:
            output_grads[num_chunks - 1].append(comm.recv_backward(tensor_shape, is_last_stage=False))
        for k in range(num_remaining, total):
            complete("backward")
            input_tensor_grad = combined_step(None, k)[1] if combined else backward_helper(k)
            recv_next, next_chunk = receives(k, forward=False)
            if overlap:
                post_backward(input_tensor_grad, recv_next, next_chunk)
                continue
            received = comm.send_backward_recv_backward(input_tensor_grad, recv_next, tensor_shape)
            if recv_next:
                output_grads[next_chunk].append(received)
        complete("backward")
        sync.enable()
        if grad_sync_funcs is not None:
            for chunk in range(num_chunks):
                if chunk not in synchronized:
                    grad_sync_funcs[chunk](model[chunk].parameters())
                    synchronized.add(chunk)
        finish_embedding_wgrad_compute(config, embedding_module, comm.is_pp_last_stage,
                                       resolve_process_group("tp", pg_collection))
        finalize_model_grads_if_set(config, list(model), total_num_tokens, pg_collection, force_all_reduce)
    else:
        sync.enable()
    if getattr(config, "fine_grained_activation_offloading", False):
        off_interface.reset()
    if getattr(config, "timers", None) is not None:
        config.timers("forward-backward").stop()
    return forward_data_store
