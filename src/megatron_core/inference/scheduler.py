"""Request pools of the static engine (Megatron-Core's ``inference.scheduler.Scheduler``).

Every request lives in ``requests`` and in one of three ordered pools: ``active_request_pool`` (at most
``max_batch_size``: the next static batch), ``waiting_request_pool`` (FIFO overflow) and
``completed_request_pool``. :meth:`Scheduler.update_requests_pools` moves a batch's finished requests to
the completed pool and refills the active pool from the waiting one in arrival order. Requests added with
``streaming=True`` get an :class:`~megatron_core.inference.async_stream.AsyncStream` in ``streams``.

Differences from Megatron-Core: a request that ended as ``FAILED`` also leaves the active pool (Megatron keeps it
there for ever); :meth:`Scheduler.fail_requests` (our addition) retires pending requests when their batch raised;
new ids skip ids already taken by requests passed in whole; a pending id added twice, unknown ids and missing
prompt tokens raise ``ValueError``. The pools are guarded by a lock, so requests can be added from the event-loop
thread while :meth:`StaticInferenceEngine.run_engine_async` runs the batches in an executor thread.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from collections import OrderedDict
from typing import Any

import torch

from megatron_core.inference.async_stream import AsyncStream
from megatron_core.inference.inference_request import ENDED_STATUSES, InferenceRequest, Status
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.utils import Counter

__all__ = ["Scheduler"]


class Scheduler:
    """Holds the static engine's requests and forms batches of at most ``max_batch_size``.

    Args:
        max_batch_size: the most requests in the active pool (one static batch).
    """

    def __init__(self, max_batch_size: int) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"Scheduler: max_batch_size ({max_batch_size!r}) must be a positive int")
        self.max_batch_size = max_batch_size
        self.requests: OrderedDict[Any, InferenceRequest] = OrderedDict()
        self.streams: OrderedDict[Any, AsyncStream] = OrderedDict()
        self.active_request_pool: OrderedDict[Any, InferenceRequest] = OrderedDict()
        self.waiting_request_pool: OrderedDict[Any, InferenceRequest] = OrderedDict()
        self.completed_request_pool: OrderedDict[Any, InferenceRequest] = OrderedDict()
        self.request_counter = Counter()
        self._lock = threading.RLock()

    def get_new_request_id(self) -> int:
        """A fresh integer id (ids of requests passed in whole are skipped)."""
        with self._lock:
            request_id = int(next(self.request_counter))
            while request_id in self.requests:
                request_id = int(next(self.request_counter))
            return request_id

    def add_request(
        self, prompt: str | None = None, prompt_tokens: list[int] | torch.Tensor | None = None,
        encoder_prompt: str | None = None, sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None, streaming: bool = False, inference_request: InferenceRequest | None = None,
        *, inference_parameters: SamplingParams | None = None,
    ) -> Any:
        """Add a request to the active pool if it has room, else to the waiting pool; returns its id.

        Either ``inference_request`` (kept as is, with its own id) or ``prompt_tokens`` (a new request with a
        new id) must be given. ``streaming=True`` opens the request's :class:`AsyncStream` (bound to the running
        event loop, else the process-wide one).
        """
        if inference_parameters is not None:
            warnings.warn("`inference_parameters` has been renamed to `sampling_params`", DeprecationWarning,
                          stacklevel=2)
            if sampling_params is None:
                sampling_params = inference_parameters
        with self._lock:
            status = (Status.ACTIVE_BUT_NOT_GENERATING_TOKENS if len(self.active_request_pool) < self.max_batch_size
                      else Status.WAITING_IN_QUEUE)
            if inference_request is None:
                if prompt_tokens is None:
                    raise ValueError(f"Scheduler.add_request: prompt_tokens is None (prompt={prompt!r}); pass the "
                                     "prompt's tokens or a whole inference_request")
                request_id = self.get_new_request_id()
                inference_request = InferenceRequest(
                    request_id=request_id, prompt=prompt, prompt_tokens=prompt_tokens, encoder_prompt=encoder_prompt,
                    sampling_params=sampling_params, arrival_time=time.time() if arrival_time is None else arrival_time,
                    status=status,
                )
            else:
                request_id = inference_request.request_id
                if request_id in self.active_request_pool or request_id in self.waiting_request_pool:
                    raise ValueError(f"Scheduler.add_request: request_id {request_id!r} is already pending")
                if inference_request.prompt_tokens is None:
                    raise ValueError(f"Scheduler.add_request: request {request_id!r} has prompt_tokens=None; "
                                     "tokenize its prompt first")
                inference_request.status = status
                if inference_request.arrival_time is None:
                    inference_request.arrival_time = time.time()
            stream = None
            if streaming:
                stream = AsyncStream(request_id, functools.partial(self.abort_request, request_id=request_id))
            self.completed_request_pool.pop(request_id, None)  # a finished id reused: the new request replaces it
            self.streams.pop(request_id, None)
            self.requests[request_id] = inference_request
            if stream is not None:
                self.streams[request_id] = stream
            pool = self.active_request_pool if status == Status.ACTIVE_BUT_NOT_GENERATING_TOKENS else \
                self.waiting_request_pool
            pool[request_id] = inference_request
            return request_id

    def num_requests_pending(self) -> int:
        """Active plus waiting requests."""
        with self._lock:
            return len(self.active_request_pool) + len(self.waiting_request_pool)

    def have_requests_pending(self) -> bool:
        """Whether any request is active or waiting."""
        return self.num_requests_pending() > 0

    def add_earliest_waiting_request_to_active_pool(self) -> None:
        """Move the oldest waiting request (if any) to the active pool, which must have room."""
        with self._lock:
            if len(self.active_request_pool) >= self.max_batch_size:
                raise ValueError(f"the active request pool is full ({len(self.active_request_pool)} of "
                                 f"max_batch_size {self.max_batch_size})")
            if self.waiting_request_pool:
                request_id, request = self.waiting_request_pool.popitem(last=False)
                request.status = Status.ACTIVE_BUT_NOT_GENERATING_TOKENS
                self.active_request_pool[request_id] = request

    def update_requests_pools(self, result_dict: dict[Any, InferenceRequest] | None = None) -> None:
        """Retire the finished requests of ``result_dict`` (a batch's results) and refill the active pool (FIFO)."""
        with self._lock:
            for request_id in list(result_dict or ()):
                if request_id not in self.active_request_pool:
                    raise ValueError(f"Scheduler.update_requests_pools: request {request_id!r} is not in the active "
                                     f"pool (active: {list(self.active_request_pool)})")
                if self.active_request_pool[request_id].status in ENDED_STATUSES:
                    self.completed_request_pool[request_id] = self.active_request_pool.pop(request_id)
            while len(self.active_request_pool) < self.max_batch_size and self.waiting_request_pool:
                self.add_earliest_waiting_request_to_active_pool()

    def abort_request(
        self, request_id: Any, *, exception: BaseException | type[BaseException] | None = None,
    ) -> None:
        """Finish the request's stream (raising ``exception`` in its reader when given); generation goes on."""
        with self._lock:
            if request_id not in self.requests:
                raise ValueError(f"Scheduler.abort_request: unknown request_id {request_id!r}")
            stream = self.streams.get(request_id)
        if stream is not None:
            stream.finish(exception=exception)

    def fail_requests(self, request_ids: list[Any], exception: BaseException) -> None:
        """Mark pending ``request_ids`` FAILED, move them to the completed pool and end their streams with ``exception``.

        The engine calls it when a batch raised, so that the next batch does not retry the same requests.
        Ids that are no longer pending are left alone. An interruption that is not an ``Exception``
        (``KeyboardInterrupt``) reaches the readers as a ``RuntimeError``.
        """
        if not isinstance(exception, Exception):
            exception = RuntimeError(f"generation was interrupted ({exception!r})")
        with self._lock:
            failed = []
            for request_id in request_ids:
                request = self.active_request_pool.pop(request_id, None)
                if request is None:
                    request = self.waiting_request_pool.pop(request_id, None)
                if request is None:
                    continue
                request.status = Status.FAILED
                self.completed_request_pool[request_id] = request
                failed.append(self.streams.get(request_id))
            while len(self.active_request_pool) < self.max_batch_size and self.waiting_request_pool:
                self.add_earliest_waiting_request_to_active_pool()
        for stream in failed:
            if stream is not None:
                stream.finish(exception=exception)
