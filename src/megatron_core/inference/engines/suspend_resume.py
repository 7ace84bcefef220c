"""Suspending the dynamic engine between rollouts and resuming it (Megatron-Core's ``DynamicInferenceEngine.suspend``,
``resume`` and ``suspend_resume_ctx``; a mixin of ``DynamicInferenceEngine``).

An RL loop that trains and generates in one process suspends the engine so that its KV cache and Mamba states stop
holding device memory while it trains. :meth:`SuspendResume.suspend`:

1. clears ``InferenceMode`` (the model is no longer serving);
2. finishes an overlapped decode step still in flight, then has the context deallocate, offload or keep its
   buffers (``InferenceConfig.kv_cache_management_mode``, see
   :mod:`~megatron_core.inference.contexts.buffer_offload`);
3. drops the decode CUDA graphs unless the mode is PERSIST (the buffers come back at other addresses);
4. sets aside the requests to re-queue on resume (``resume_request_ids``): the waiting ones, and in RECOMPUTE mode
   the active ones too (oldest first, ahead of the waiting ones). Those lose their KV blocks and Mamba slots, as an
   eviction does (an ``EVICT`` event), and will prefill their prompt and the tokens generated so far again, which
   leaves greedy outputs unchanged (Megatron-Core checkpoints the request record into a new prompt instead).

:meth:`SuspendResume.resume` undoes it: ``InferenceMode`` set, buffers back (RECOMPUTE: zeroed, the context's
requests and prefix cache forgotten), requests re-queued. CUDA graphs are captured again by the next decode step of
each batch size, as at start-up. Both are idempotent. Without the coordinator they set the state (SUSPENDED, then
RUNNING); under it the coordinator link drives the SUSPENDING / RESUMING transitions. A step asked of a suspended
engine raises :class:`EngineSuspendedError`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from megatron_core.inference.config import KVCacheManagementMode
from megatron_core.inference.inference_request import ENDED_STATUSES, Status
from megatron_core.inference.model_inference_wrappers.cuda_graphs import DecodeGraphRunner
from megatron_core.inference.utils import InferenceMode

__all__ = ["EngineSuspendedError", "SuspendResume"]

logger = logging.getLogger(__name__)


class EngineSuspendedError(Exception):
    """A step was asked of a suspended (or suspending) engine; the exception's argument is the context's step count."""


def _device_memory() -> tuple[int, int] | None:
    """``(allocated, reserved)`` bytes of the current CUDA device, or ``None`` where CUDA is not in use."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


class SuspendResume:
    """Mixin over the engine's ``state``, ``context``, ``controller``, ``requests``, ``waiting``, ``running``,
    ``paused_request_ids``, ``speculative_drafts``, ``use_coordinator``, ``_step_lock``, ``_inflight``,
    ``_drain_inflight``, ``_recover_from_step_error`` and ``_notify``."""

    resume_request_ids: list[Any]

    @staticmethod
    @contextlib.contextmanager
    def suspend_resume_ctx(key: str, *, unified_memory_level: int) -> Iterator[None]:
        """Log how long the block took and how much device memory it freed or took (``key``: "suspended" /
        "resumed")."""
        start_memory, start = _device_memory(), time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            end_memory = _device_memory()
            rank = torch.distributed.get_rank() if torch.distributed.is_available() and \
                torch.distributed.is_initialized() else 0
            if start_memory is None or end_memory is None:
                memory = "no CUDA memory in use"
            else:
                change = end_memory[0] - start_memory[0]
                memory = (f"{'allocating' if change > 0 else 'deallocating'} {abs(change) / 1024**3:.3f} gb; now "
                          f"alloc {end_memory[0] / 1024**3:.3f} gb, res {end_memory[1] / 1024**3:.3f} gb")
            logger.info("[rank %d] dynamic engine %s, unified %d, %s in %.3f s", rank, key, unified_memory_level,
                        memory, elapsed)

    @property
    def is_suspended(self) -> bool:
        """Whether the engine is suspended or suspending."""
        states = type(self.state)
        return self.state in (states.SUSPENDING, states.SUSPENDED)

    def suspend(self) -> None:
        """Free (or offload, or keep) the context's buffers and set requests aside; see the module docstring."""
        states = type(self.state)
        if self.is_suspended:
            return
        InferenceMode.unset_active()
        if not self.use_coordinator:
            self.state = states.SUSPENDING  # a loop that checked RUNNING before this does not step
        context = self.context
        mode = context.kv_cache_management_mode
        with self._step_lock:
            inflight = [e.request_id for e in self._inflight.entries] if self._inflight is not None else []
            try:
                self._drain_inflight()
            except Exception as error:  # noqa: BLE001 - contained as a failed step is (see fault_isolation)
                self._recover_from_step_error(error, inflight)
            with self.suspend_resume_ctx("suspended", unified_memory_level=context.inference_config.unified_memory_level):
                context.deallocate_inference_state_buffers()
                if mode != KVCacheManagementMode.PERSIST:
                    self._delete_cuda_graphs()
            recompute: list[Any] = []
            if mode == KVCacheManagementMode.RECOMPUTE:
                recompute = list(self.running)
                for request_id in recompute:
                    request = self.requests[request_id]
                    context.release_request(request_id)
                    self.speculative_drafts.pop(request_id, None)
                    request.add_event_evict()
                    request.status = Status.WAITING_IN_QUEUE
                self.running = []
                self.paused_request_ids = []
            self.resume_request_ids = [*recompute, *self.waiting]
            self.waiting.clear()
        if not self.use_coordinator:
            self.state = states.SUSPENDED

    def resume(self) -> None:
        """Bring the buffers back and re-queue the requests set aside by :meth:`suspend`."""
        states = type(self.state)
        if not self.is_suspended:
            return
        InferenceMode.set_active()
        context = self.context
        with self._step_lock:
            with self.suspend_resume_ctx("resumed", unified_memory_level=context.inference_config.unified_memory_level):
                context.reinitialize_inference_state_buffers()
            live = [r for r in self.resume_request_ids if r in self.requests
                    and self.requests[r].status not in ENDED_STATUSES]
            self.waiting.extend(live)
            self.resume_request_ids = []
        if not self.use_coordinator:
            self.state = states.RUNNING
            self._notify()

    def _delete_cuda_graphs(self) -> None:
        """Forget the decode CUDA graphs (captured over buffers that are going away); the next decode step of each
        batch size captures its graph again."""
        wrapper = self.controller.inference_wrapped_model
        if getattr(wrapper, "decode_graphs", None) is not None and wrapper.decode_graphs.graphs:
            wrapper.decode_graphs = DecodeGraphRunner()
