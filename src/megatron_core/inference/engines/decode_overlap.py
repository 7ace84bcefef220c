"""Decode steps that overlap the host's work with the device's (a mixin of ``DynamicInferenceEngine``).

Megatron-Core's ``AsyncScheduleMode.ASYNC`` ("prepare before resolve"). In a decode-only step laid
out for CUDA graphs, the host spends about as long preparing the step
and reading its tokens back as the device spends running it. So the engine does not wait for a
step's tokens before it prepares the next one:

1. step ``t`` is launched: forward and sampling are queued, and its tokens start copying to
   pinned host memory;
2. while the device runs it, the host lays out step ``t + 1`` for the same requests, each at its
   next position, and launches it with token ids gathered *on the device* from step ``t``'s samples;
3. only then does the host wait for step ``t``'s tokens and do the bookkeeping (append, stream,
   stop checks).

Requests that reach their length limit at step ``t`` are known in advance and left out of step
``t + 1``. A request that stops on its termination token or a stop word at step ``t`` has already
fed one more token in step ``t + 1``: that row's sample is dropped, and its KV blocks are freed
after step ``t + 1`` was queued (later steps run after it on the same stream, so reusing them is
safe). Step ``t + 1`` is only prepared when the next step would hold exactly the same requests: no
request prefilling or paused, none cancelled, and no waiting request that could be admitted;
otherwise the engine finishes step ``t`` and schedules the next step as usual.

Greedy outputs are identical to stepping one at a time. Sampled outputs reproduce from run to run,
but a dropped row still draws from the sampling generator, so they can differ from the
non-overlapped engine's. Steps that need log-probs, pipeline-parallel models, and models that record
their MoE routing (``moe_enable_routing_replay``) are not overlapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_core.inference.contexts.dynamic_context import StepEntry
from megatron_core.inference.inference_request import ENDED_STATUSES
from megatron_core.inference.text_generation_controllers.text_generation_controller import DynamicStepOutput

__all__ = ["DecodeOverlap", "TokenReadback"]


class TokenReadback:
    """Copies sampled token ids to the host without blocking: two pinned buffers used in turn (CUDA)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._buffers = [torch.empty(capacity, dtype=torch.long, pin_memory=True) for _ in range(2)] if self._cuda else []
        self._events = [torch.cuda.Event() for _ in range(2)] if self._cuda else []
        self._next = 0

    def start(self, tokens: torch.Tensor) -> Any:
        """Queue the copy of ``tokens`` ``[n]``; returns a handle for :meth:`result`."""
        if not self._cuda:
            return tokens
        slot = self._next
        self._next ^= 1
        buffer = self._buffers[slot][: tokens.numel()]
        buffer.copy_(tokens, non_blocking=True)
        self._events[slot].record()
        return buffer, self._events[slot]

    def result(self, handle: Any) -> list[int]:
        """The token ids of a started copy (waits for it)."""
        if not self._cuda:
            return handle.tolist()
        buffer, event = handle
        event.synchronize()
        return buffer.tolist()


@dataclass
class InflightStep:
    """A launched decode step whose tokens the host has not read yet."""

    entries: list[StepEntry]
    tokens: torch.Tensor  # [n] on the device, row i for entries[i]
    readback: Any


class DecodeOverlap:
    """Mixin over the engine's ``context``, ``controller``, ``requests``, ``running``, ``waiting``,
    ``_bookkeep`` and ``_stops_by_length``."""

    overlap_decode_steps: bool = False  # the engine sets it from InferenceConfig.async_sched_mode
    _inflight: InflightStep | None = None
    _readback: TokenReadback | None = None
    overlapped_step_count: int = 0  # steps launched before the previous step's tokens were read
    dropped_row_count: int = 0  # rows of overlapped steps whose request had already finished

    def _can_overlap(self, entries: list[StepEntry]) -> bool:
        """Whether the laid-out step may run without waiting for its tokens."""
        if not self.overlap_decode_steps or self.context.graph_batch_size is None:
            return False
        if self.context.moe_routing_metadata is not None:  # routing is read back after each forward
            return False
        if self.controller.inference_wrapped_model.pp_group is not None:
            return False
        requests = self.requests
        for entry in entries:
            params = requests[entry.request_id].sampling_params
            if params.return_log_probs or params.top_n_logprobs:
                return False
        return True

    def _launch(self, entries: list[StepEntry]) -> InflightStep:
        """Queue forward and sampling of the laid-out step and start reading its tokens back."""
        requests = self.requests
        params = {e.request_id: requests[e.request_id].sampling_params for e in entries}
        tokens = self.controller.sample_step_on_device(params)
        if self._readback is None:
            self._readback = TokenReadback(self.context.graph_sizes[-1], tokens.device)
        self.step_count += 1
        return InflightStep(list(self.context.step_entries), tokens, self._readback.start(tokens))

    def _next_step_of(self, step: InflightStep) -> tuple[list[StepEntry], list[int]] | None:
        """The entries of the step after ``step`` (same requests, next positions) and their token rows.

        ``None`` when that step could differ from what the scheduler would build (see the module doc)
        or a request needs a block that is not free. Blocks it grows stay with their requests.
        """
        ctx = self.context
        if not self.overlap_decode_steps or len(self.running) != len(step.entries) or self.paused_request_ids:
            return None
        if self.waiting and ctx.total_request_count < ctx.max_requests:
            return None
        block_size, blocks_of, kv_lengths = ctx.block_size_tokens, ctx.request_blocks, ctx.request_kv_length
        entries, rows = [], []
        for row, entry in enumerate(step.entries):
            if not self._is_live(entry.request_id) or entry.request_id not in blocks_of:
                return None
            request = self.requests[entry.request_id]
            if self._stops_by_length(request, len(request.generated_tokens) + 1):
                continue  # its token of this step is its last
            kv = kv_lengths[entry.request_id]
            if kv >= len(blocks_of[entry.request_id]) * block_size and not ctx.grow_request(entry.request_id, kv + 1):
                return None
            entries.append(StepEntry(entry.request_id, [0], kv))
            rows.append(row)
        return (entries, rows) if entries else None

    def _is_live(self, request_id: Any) -> bool:
        """Whether the request is still in the engine and has not finished (completed, failed or cancelled)."""
        request = self.requests.get(request_id)
        return request is not None and request.status not in ENDED_STATUSES

    def _finish_inflight(self, step: InflightStep) -> None:
        """Wait for ``step``'s tokens and book them (rows of requests that already finished are dropped)."""
        tokens = self._readback.result(step.readback)
        keep = [i for i, e in enumerate(step.entries) if self._is_live(e.request_id)]
        if len(keep) != len(step.entries):
            self.dropped_row_count += len(step.entries) - len(keep)
            step.entries = [step.entries[i] for i in keep]
            tokens = [tokens[i] for i in keep]
        self._bookkeep(step.entries, DynamicStepOutput.tokens_only(tokens))

    def _advance_overlapped(self) -> int:
        """Launch the step after the in-flight one if possible, then finish the in-flight one; its token count."""
        step, self._inflight = self._inflight, None
        assert step is not None
        following = self._next_step_of(step)
        if following is not None:
            entries, rows = following
            self.context.initialize_attention_state(entries, device_tokens=step.tokens, device_token_rows=rows)
            self._inflight = self._launch(entries)
            self.overlapped_step_count += 1
        self._finish_inflight(step)
        if self._inflight is not None and not any(self._is_live(e.request_id) for e in self._inflight.entries):
            self._drain_inflight()  # every request of the queued step has finished: nothing to wait for later
        return len(step.entries)

    def _drain_inflight(self) -> None:
        """Finish the in-flight step, if any, without launching another."""
        step, self._inflight = self._inflight, None
        if step is not None:
            self._finish_inflight(step)

    def _discard_inflight(self) -> None:
        """Wait for the in-flight step, if any, and drop its tokens (the engine is being reset)."""
        step, self._inflight = self._inflight, None
        if step is not None:
            self._readback.result(step.readback)
