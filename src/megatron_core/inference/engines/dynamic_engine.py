"""Continuous batching over the paged KV cache (Megatron-Core's ``engines.dynamic_engine.DynamicInferenceEngine``).

``add_request`` queues a request (thread-safe; returns a ``concurrent.futures.Future`` of the
finished :class:`DynamicInferenceRequest`). Each :meth:`step_modern` schedules one forward:

1. every running request that is decoding feeds its last token (oldest first); one that needs
   a new KV block when none is free is *paused* for this step (keeps its blocks);
2. running requests still prefilling feed their next prompt chunk;
3. waiting requests are admitted (FIFO) while no request is paused and there are free request
   slots, step tokens (``max_tokens``) and KV blocks for their first chunk;
4. if nothing at all can run, the youngest running request is *evicted*: its blocks are freed
   and it goes back to the front of the queue, to be re-prefilled with its prompt and the tokens
   it generated so far (greedy outputs are unchanged by an eviction).

Prefill and decode share the step. With ``enable_chunked_prefill`` (always for re-admitted
requests) a prompt longer than the step's remaining token budget is split over several steps.
Requests finish on the termination token, a stop word, ``num_tokens_to_generate``, or
``max_sequence_length`` (booked in :mod:`.token_bookkeeping`); they can be cancelled (:meth:`cancel_request`), which frees their blocks
at the next step boundary. Requests that can never fit are refused in ``add_request`` with a
:class:`RequestRejectedError` (a ``ValueError`` naming the setting). Failures while serving are
contained as :mod:`.fault_isolation` describes. When the model has ``moe_enable_routing_replay``, a completed
request carries ``routing_indices``: the experts of each of its tokens fed to the model (see
:mod:`~megatron_core.inference.contexts.routing_metadata`). Between rollouts, :meth:`~DynamicInferenceEngine.suspend`
frees (or offloads, or keeps) the KV cache and :meth:`~DynamicInferenceEngine.resume` brings it back
(:mod:`.suspend_resume`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch

from megatron_core._ground.decorators import deprecate_args
from megatron_core.inference.config import AsyncScheduleMode
from megatron_core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_core.inference.engines.abstract_engine import AbstractEngine
from megatron_core.inference.engines.decode_overlap import DecodeOverlap
from megatron_core.inference.engines.fault_isolation import (
    CANCELLED,
    EngineFailedError,
    FaultIsolation,
    RequestRejectedError,
    describe,
)
from megatron_core.inference.engines.model_support import check_model_supported
from megatron_core.inference.engines.step_scheduler import StepScheduler
from megatron_core.inference.engines.suspend_resume import EngineSuspendedError, SuspendResume
from megatron_core.inference.engines.token_bookkeeping import TokenBookkeeping
from megatron_core.inference.inference_request import (
    ENDED_STATUSES,
    DynamicInferenceEventType,
    DynamicInferenceRequest,
    DynamicInferenceRequestRecord,
    Status,
)
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers.speculative_step import num_mtp_depths
from megatron_core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from megatron_core.inference.utils import Counter, InferenceMode

__all__ = ["DEPRECATED_ARGS", "DynamicInferenceEngine", "EngineFailedError", "EngineState", "EngineSuspendedError",
           "RequestRejectedError", "format_mem_bytes"]

logger = logging.getLogger(__name__)

TokenListener = Callable[[DynamicInferenceRequest, "int | None"], None]

DEPRECATED_ARGS = ["enable_cuda_graph", "random_seed", "track_paused_request_events", "enable_chunked_prefill",
                   "inference_logging_step_interval", "pg_collection"]
"""Former ``DynamicInferenceEngine`` keyword arguments (now ``InferenceConfig`` fields); passing one raises
``TypeError``."""


def format_mem_bytes(mem_bytes: float) -> str:
    """A byte count with one decimal in the largest unit it reaches: ``"1.5 gb"``, ``"-2.0 kb"``, ``"12 bytes"``
    (tb, gb, mb, kb: powers of 1024)."""
    if mem_bytes < 0:
        return "-" + format_mem_bytes(-mem_bytes)
    for power, suffix in ((4, "tb"), (3, "gb"), (2, "mb"), (1, "kb"), (0, "bytes")):
        if mem_bytes >= 1024**power:
            return f"{mem_bytes / 1024**power:.1f} {suffix}"
    return f"{int(mem_bytes)} bytes"


class EngineState(Enum):
    """Lifecycle of the engine loop (the ``-ING`` states and RESUMED: coordinator mode only; SUSPENDED also after
    :meth:`DynamicInferenceEngine.suspend` without the coordinator, SUSPENDING while it runs)."""

    RUNNING = 1
    PAUSED = 2
    STOPPING = 3
    STOPPED = 4
    PAUSING = 5
    UNPAUSING = 6
    SUSPENDING = 7
    SUSPENDED = 8
    RESUMING = 9
    RESUMED = 10


class DynamicInferenceEngine(StepScheduler, TokenBookkeeping, DecodeOverlap, SuspendResume, FaultIsolation,
                             AbstractEngine):
    """Schedules requests into steps over a :class:`DynamicInferenceContext`.

    With ``InferenceConfig.async_sched_mode=AsyncScheduleMode.ASYNC``, decode steps laid out for CUDA
    graphs overlap the host's work with the device's (:mod:`.decode_overlap`); the engine attribute
    ``overlap_decode_steps`` holds the choice and can be switched between steps.
    """

    @deprecate_args(*DEPRECATED_ARGS, message="Argument `{name}` has been deprecated. Only pass `controller` and "
                    "`context`")
    def __init__(self, controller: TextGenerationController, context: DynamicInferenceContext) -> None:
        self.controller = controller
        self.context = context
        controller.inference_wrapped_model.inference_context = context
        check_model_supported(controller.inference_wrapped_model.model, controller.inference_wrapped_model.config,
                              context)
        controller.inference_wrapped_model.prep_model_for_inference()
        self.overlap_decode_steps = context.inference_config.async_sched_mode == AsyncScheduleMode.ASYNC
        self.num_speculative_tokens = context.num_speculative_tokens
        if self.num_speculative_tokens:
            _check_speculative_model(controller, self.num_speculative_tokens)
        self.request_counter = Counter()
        self.state = EngineState.RUNNING
        self.use_coordinator = False  # the coordinator link sets it; it then drives the suspend / resume states
        self._inbox_lock = threading.Lock()
        self._inbox: list[DynamicInferenceRequest] = []
        self._cancels: set[Any] = set()
        self._step_lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._init_fault_isolation()
        self.reset()
        InferenceMode.set_active()

    def reset(self) -> None:
        """Forget every request and free the cache."""
        self._discard_inflight()
        self.requests: dict[Any, DynamicInferenceRequest] = {}
        self.futures: dict[Any, concurrent.futures.Future] = {}
        self.listeners: dict[Any, list[TokenListener]] = {}
        self.waiting: deque[Any] = deque()
        self.resume_request_ids: list[Any] = []  # set aside by suspend(), re-queued by resume()
        self.running: list[Any] = []
        self.paused_request_ids: list[Any] = []
        self._just_finished: list[DynamicInferenceRequest] = []
        self.step_count = 0
        self.evicted_request_count = 0
        self.cancelled_request_count = 0
        # Speculative decoding: each decoding request's MTP drafts for its next step, drafts verified / accepted.
        self.speculative_drafts: dict[Any, list[int]] = {}
        self.speculative_drafted_count = 0
        self.speculative_accepted_count = 0
        self._suspects.clear()
        self.context.reset()

    # ---- adding and removing requests ---------------------------------------------------------------

    def _tokens_of(self, prompt: str | list[int] | torch.Tensor, params: SamplingParams) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            try:
                return prompt, self.controller.tokenize_prompt(self.controller.tokenizer, prompt, params.add_BOS)
            except (ValueError, TypeError, KeyError, IndexError, UnicodeError) as error:
                raise RequestRejectedError(f"the prompt cannot be tokenized: {describe(error)}") from error
        if isinstance(prompt, torch.Tensor):
            return None, [int(t) for t in prompt.reshape(-1).tolist()]
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise RequestRejectedError(
            f"prompt must be a str, a list of token ids or a 1-D tensor, got {type(prompt).__name__}"
        )

    def _validate(self, request_id: Any, tokens: list[int], params: SamplingParams) -> None:
        ctx = self.context
        if not tokens:
            raise RequestRejectedError(f"request {request_id}: the prompt has no tokens")
        vocab = self.sampling_vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise RequestRejectedError(
                f"request {request_id}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        if params.top_k > vocab:
            raise RequestRejectedError(
                f"request {request_id}: top_k ({params.top_k}) is larger than the vocabulary ({vocab})", "top_k"
            )
        if params.top_n_logprobs > vocab:
            raise RequestRejectedError(
                f"request {request_id}: top_n_logprobs ({params.top_n_logprobs}) is larger than the vocabulary "
                f"({vocab})", "top_n_logprobs",
            )
        total = len(tokens) + (params.num_tokens_to_generate or 0)
        if params.num_tokens_total is not None:
            total = max(len(tokens), params.num_tokens_total)
        if total > ctx.max_sequence_length or len(tokens) >= ctx.max_sequence_length:
            raise RequestRejectedError(
                f"request {request_id}: prompt ({len(tokens)} tokens) + num_tokens_to_generate "
                f"({params.num_tokens_to_generate}) exceeds max_sequence_length ({ctx.max_sequence_length})",
                "prompt" if len(tokens) >= ctx.max_sequence_length else "num_tokens_to_generate",
            )
        if not ctx.enable_chunked_prefill and len(tokens) > ctx.max_tokens:
            raise RequestRejectedError(
                f"request {request_id}: prompt ({len(tokens)} tokens) exceeds max_tokens ({ctx.max_tokens}) per step; "
                "enable InferenceConfig.enable_chunked_prefill or raise max_tokens"
            )
        longest = total if params.num_tokens_to_generate is not None or params.num_tokens_total else ctx.max_sequence_length
        if ctx.blocks_for_tokens(longest) > ctx.total_block_count:
            raise RequestRejectedError(
                f"request {request_id}: up to {longest} tokens need {ctx.blocks_for_tokens(longest)} KV blocks but the "
                f"cache holds {ctx.total_block_count} (raise buffer_size_gb or set num_tokens_to_generate)",
                "num_tokens_to_generate",
            )

    @property
    def sampling_vocab_size(self) -> int:
        """Tokens the sampler chooses from: the tokenizer's vocabulary, else the model's (padded) one."""
        return self.controller.vocab_size or int(self.controller.inference_wrapped_model.inner_model.vocab_size)

    def add_request(
        self, request_id: Any, prompt: str | list[int] | torch.Tensor, sampling_params: SamplingParams | None = None,
    ) -> concurrent.futures.Future:
        """Queue a request; the future resolves to the finished :class:`DynamicInferenceRequest`."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        self._check_alive()
        params.validate()
        prompt_text, tokens = self._tokens_of(prompt, params)
        with self._inbox_lock:
            if request_id in self.requests or any(r.request_id == request_id for r in self._inbox):
                raise ValueError(f"request_id {request_id!r} is already in the engine")
        self._validate(request_id, tokens, params)
        request = DynamicInferenceRequest(
            request_id=request_id, prompt=prompt_text, prompt_tokens=tokens, sampling_params=params,
            block_size_tokens=self.context.block_size_tokens, enable_prefix_caching=self.context.enable_prefix_caching,
        )
        request.add_event(DynamicInferenceEventType.ADD)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._inbox_lock:
            self._check_alive()  # under the lock: a loop failing now either sees this request or refuses it
            self.futures[request_id] = future
            self._inbox.append(request)
        self._notify()
        return future

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise EngineFailedError(f"the inference engine stopped after an error: {describe(self.failure)}")

    def add_token_listener(self, request_id: Any, listener: TokenListener) -> None:
        """Call ``listener(request, token)`` after each generated token, and ``listener(request, None)`` at the end."""
        with self._inbox_lock:
            self.listeners.setdefault(request_id, []).append(listener)

    def remove_token_listeners(self, request_id: Any) -> None:
        """Forget the listeners of ``request_id`` (a request that was refused never calls them)."""
        with self._inbox_lock:
            self.listeners.pop(request_id, None)

    def cancel_request(self, request_id: Any) -> None:
        """Stop a request at the next step boundary and free its KV blocks (it finishes as FAILED)."""
        with self._inbox_lock:
            self._cancels.add(request_id)
        self._notify()

    def has_unfinished_requests(self) -> bool:
        """Whether any request is queued, waiting or running (safe to call from another thread).

        Judged by the requests' own status, which the engine changes in one assignment, rather than by its
        queues, which a step moves requests between in several.
        """
        with self._inbox_lock:
            if self._inbox or self._cancels:
                return True
            requests = list(self.requests.values())  # one copy under the GIL; the step thread may change the dict
        return any(r.status not in ENDED_STATUSES for r in requests)

    def get_request(self, request_id: Any) -> DynamicInferenceRequest:
        """The request object (live while it runs)."""
        return self.requests[request_id]

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
            for request in inbox:  # under the lock: has_unfinished_requests never sees a request in neither place
                self.requests[request.request_id] = request
        for request in inbox:
            self.waiting.append(request.request_id)
        for request_id in cancels:
            request = self.requests.get(request_id)
            if request is None or request.status in ENDED_STATUSES:
                continue
            if request_id in self.waiting:
                self.waiting.remove(request_id)
            if request_id in self.resume_request_ids:
                self.resume_request_ids.remove(request_id)
            if request_id in self.running:
                self.running.remove(request_id)
            self.context.release_request(request_id)
            self.cancelled_request_count += 1
            self._finish(request, Status.FAILED, error=CANCELLED)

    # ---- one step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def step_modern(self) -> dict[str, Any]:
        """Run one step; returns ``active_request_ids``, ``finished_request_records``, ``step_time``.

        Raises :class:`EngineSuspendedError` while the engine is suspended (see :meth:`suspend`).
        """
        with self._step_lock:
            if self.is_suspended:
                raise EngineSuspendedError(self.context.step_count)
            start = time.perf_counter()
            self._drain_inbox()
            involved: list[Any] = []
            try:
                num_tokens = self._run_step(involved)
            except Exception as error:  # noqa: BLE001 - contained per request, see fault_isolation
                self._recover_from_step_error(error, involved)
                num_tokens = 0
            finished = [DynamicInferenceRequestRecord.from_request(r) for r in self._just_finished]
            self._just_finished = []
            for record in finished:  # finished requests leave the engine
                self.requests.pop(record.request_id, None)
            return {
                "active_request_ids": list(self.running),
                "paused_request_ids": list(self.paused_request_ids),
                "finished_request_records": finished,
                "step_time": time.perf_counter() - start,
                "num_tokens": num_tokens,
            }

    def _run_step(self, involved: list[Any]) -> int:
        """Schedule, run and book one step; ``involved`` collects its request ids as they are known."""
        num_tokens = 0
        if self._inflight is None:
            entries = self.schedule_requests()
            involved.extend(e.request_id for e in entries)
            if entries:
                self.context.initialize_attention_state(entries)
                if self._can_overlap(self.context.step_entries):
                    self._inflight = self._launch(self.context.step_entries)
                else:
                    params = {e.request_id: self.requests[e.request_id].sampling_params for e in entries}
                    output = self.controller.generate_output_tokens_dynamic_batch(params)
                    self._bookkeep(self.context.step_entries, output)
                    self.step_count += 1
                    num_tokens = sum(len(e.tokens) for e in entries)
        if self._inflight is not None:
            involved.extend(e.request_id for e in self._inflight.entries)
            num_tokens = self._advance_overlapped()
        return num_tokens

    def step(self, sampling_params: SamplingParams | None = None) -> tuple[list, list, float]:
        """Legacy form of :meth:`step_modern`: ``(active requests, finished requests, step time)``."""
        result = self.step_modern()
        active = [self.requests[i] for i in result["active_request_ids"]]
        return active, [r.merge() for r in result["finished_request_records"]], result["step_time"]

    def _finish(self, request: DynamicInferenceRequest, status: Status, error: str | None = None) -> None:
        params = request.sampling_params
        self.speculative_drafts.pop(request.request_id, None)
        request.status = status
        request.error = error
        request.latency = time.monotonic() - request.arrival_time
        request.generated_length = len(request.generated_tokens)
        try:
            text, segments = self.controller.detokenize_generations(
                request.generated_tokens, self.controller.termination_id(params), params.detokenize_stop_sequence,
                params.return_segments,
            )
        except Exception as detokenize_error:  # noqa: BLE001 - the request still finishes (its future must resolve)
            logger.error("request %s: detokenizing its output failed", request.request_id, exc_info=detokenize_error)
            text, segments = "", None
            if status == Status.COMPLETED:
                status, error = Status.FAILED, f"internal error while detokenizing: {describe(detokenize_error)}"
                self.failed_request_count += 1
        if params.stop_words and not params.detokenize_stop_sequence:
            for word in params.stop_words:
                if text.endswith(word):
                    text = text[: -len(word)]
                    break
        request.generated_text = text
        request.generated_segments = segments
        if status == Status.COMPLETED:
            request.add_event_finish()
        else:
            request.add_event_fail(error)
        self._just_finished.append(request)
        self._notify_token(request, None)
        with self._inbox_lock:
            future = self.futures.pop(request.request_id, None)
            self.listeners.pop(request.request_id, None)
        if future is not None and not future.done():
            future.set_result(request)

    def _notify_token(self, request: DynamicInferenceRequest, token: int | None) -> None:
        if request.request_id not in self.listeners:  # the usual case, checked without the lock
            return
        with self._inbox_lock:
            listeners = list(self.listeners.get(request.request_id, ()))
        for listener in listeners:
            try:
                listener(request, token)
            except Exception as error:  # noqa: BLE001 - a consumer that went away must not stop the engine
                logger.warning("request %s: dropping a token listener that raised %s", request.request_id,
                               describe(error))
                with self._inbox_lock:
                    kept = self.listeners.get(request.request_id)
                    if kept is not None and listener in kept:
                        kept.remove(listener)

    # ---- driving the engine -----------------------------------------------------------------------

    def generate(
        self, prompts: list[str] | list[list[int]], sampling_params: SamplingParams | None = None
    ) -> list[DynamicInferenceRequestRecord]:
        """Serve a list of prompts to completion; records in input order."""
        futures = [self.add_request(next(self.request_counter), p, sampling_params) for p in prompts]
        while not all(f.done() for f in futures):
            self.step_modern()
        return [DynamicInferenceRequestRecord.from_request(f.result()) for f in futures]

    def _notify(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    async def run_engine(self, *, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Step (in a worker thread) while there is work, sleep while idle, until :meth:`shutdown`."""
        self._loop = loop or asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.state = EngineState.RUNNING
        try:
            while self.state != EngineState.STOPPING:
                if self.has_unfinished_requests() and self.state == EngineState.RUNNING:
                    try:
                        await asyncio.to_thread(self.step_modern)
                    except EngineSuspendedError:
                        continue  # suspended between the state check and the step: wait for resume()
                else:
                    self._wake.clear()
                    if self.has_unfinished_requests() and self.state == EngineState.RUNNING:
                        continue
                    await self._wake.wait()
        except Exception as error:
            self._fail_engine(error)
            raise
        finally:
            self.state = EngineState.STOPPED

    async def shutdown(self, cancel_pending: bool = True) -> None:
        """Stop the loop; with ``cancel_pending`` every unfinished request is cancelled (finishes as FAILED)."""
        if cancel_pending:
            with self._inbox_lock:
                pending = [r.request_id for r in self._inbox] + list(self.requests)
            for request_id in pending:
                self.cancel_request(request_id)
            if self.is_suspended:  # no step: cancelling touches no tensor
                with self._step_lock:
                    self._drain_inbox()
            else:
                await asyncio.to_thread(self.step_modern)
        self.state = EngineState.STOPPING
        self._notify()

    async def start_listening_to_data_parallel_coordinator(
        self, inference_coordinator_port: int | None = None, launch_inference_coordinator: bool = True, *,
        hostname: str | None = None, coordinator_schedule_output_path: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> str | None:
        """Serve requests from the data-parallel inference coordinator (a collective; see :mod:`.coordinator_link`)."""
        from megatron_core.inference.engines.coordinator_link import (
            start_listening_to_data_parallel_coordinator,
        )

        return await start_listening_to_data_parallel_coordinator(
            self, inference_coordinator_port, launch_inference_coordinator, hostname=hostname,
            coordinator_schedule_output_path=coordinator_schedule_output_path, loop=loop)

    async def wait_until(self, state: EngineState) -> None:
        """Wait until the engine reaches ``state`` (RUNNING, PAUSED, SUSPENDED, RESUMED or STOPPED)."""
        from megatron_core.inference.engines.coordinator_link import wait_until

        await wait_until(self, state)

    def pause(self) -> None:
        """Stop stepping (requests keep their state)."""
        self._refuse_while_suspended("pause")
        self.state = EngineState.PAUSED

    def unpause(self) -> None:
        """Resume stepping."""
        self._refuse_while_suspended("unpause")
        self.state = EngineState.RUNNING
        self._notify()

    def _refuse_while_suspended(self, call: str) -> None:
        if self.is_suspended:
            raise RuntimeError(f"{call}: the engine is suspended (its KV cache is released); call resume() first")


def _check_speculative_model(controller: TextGenerationController, num_speculative_tokens: int) -> None:
    """Refuse speculative decoding for a model that cannot draft (no MTP layers here, pipeline stages)."""
    wrapper = controller.inference_wrapped_model
    num_mtp_depths(wrapper.config, num_speculative_tokens)
    if wrapper.pp_group is not None:
        raise ValueError(f"InferenceConfig.num_speculative_tokens ({num_speculative_tokens}) is not supported with "
                         "pipeline parallelism (pipeline_model_parallel_size > 1)")
    if getattr(wrapper.inner_model, "mtp", None) is None or not hasattr(wrapper.inner_model, "compute_mtp_single_step"):
        raise ValueError(f"InferenceConfig.num_speculative_tokens ({num_speculative_tokens}) drafts with the model's "
                         f"MTP layers, but {type(wrapper.inner_model).__name__} has none (build it with "
                         "mtp_block_spec and mtp_num_layers >= 1)")
