"""An asyncio client of the data-parallel inference coordinator (Megatron-Core's ``InferenceClient``).

A ZMQ DEALER socket connected to the coordinator's ROUTER. :meth:`InferenceClient.start` does the
CONNECT handshake and starts a task on the event loop that reads replies; :meth:`add_request`
sends a prompt with its :class:`SamplingParams` and returns an ``asyncio.Future`` that resolves to
the finished request: its serialized dict, or a :class:`DynamicInferenceRequest` with
``deserialize=True``. A request that failed (refused by the engine, unreadable, its engine gone)
resolves too, with status ``FAILED`` and ``error`` saying why. The ``*_engines`` methods send
control signals that the coordinator forwards to every engine. The socket and the loop's task are
used from the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from megatron_core._ground.async_utils import get_asyncio_loop
from megatron_core.inference._request_wire import deserialize_request
from megatron_core.inference._zmq import pack, unpack, zmq_module
from megatron_core.inference.headers import Headers, UnknownHeaderError, decode_header
from megatron_core.inference.sampling_params import SamplingParams

__all__ = ["InferenceClient"]

logger = logging.getLogger(__name__)

_IDLE_SLEEP_S = 0.005  # the reply task's pause when no reply is waiting


class InferenceClient:
    """Submits requests to a :class:`DataParallelInferenceCoordinator` and resolves their futures.

    Attributes:
        socket: the DEALER socket. completion_futures: client request id -> future of the finished request.
        next_request_id: the id the next request gets. listener_task: the reply-reading task.
    """

    def __init__(self, inference_coordinator_address: str, deserialize: bool = False) -> None:
        zmq = zmq_module()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # many requests in flight must never block send()
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(inference_coordinator_address)
        self.deserialize = deserialize
        self.completion_futures: dict[int, asyncio.Future] = {}
        self.request_submission_times: dict[int, float] = {}
        self.next_request_id = 0
        self.listener_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> asyncio.Future:
        """Send one request; the returned future resolves to the finished request (call from the event loop)."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if hasattr(prompt, "tolist"):  # a tensor or array of token ids
            prompt = prompt.tolist()
        request_id = self.next_request_id
        self.next_request_id += 1
        future = asyncio.get_running_loop().create_future()
        self.completion_futures[request_id] = future
        self.request_submission_times[request_id] = time.perf_counter()
        self.socket.send(pack([Headers.SUBMIT_REQUEST.value, request_id, prompt, params.serialize()]))
        return future

    async def _recv_task(self) -> None:
        """Read replies until cancelled, resolving each request's future."""
        zmq = zmq_module()
        while True:
            try:
                data = self.socket.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                await asyncio.sleep(_IDLE_SLEEP_S)
                continue
            try:
                self._handle_reply(unpack(data))
            except (ValueError, UnknownHeaderError, TypeError) as error:
                logger.warning("InferenceClient: dropping an unreadable reply: %s", error)

    def _handle_reply(self, message: Any) -> None:
        if not isinstance(message, list) or not message:
            raise ValueError(f"a reply must be a msgpack array, got {type(message).__name__}")
        header = decode_header(message[0])
        if header != Headers.ENGINE_REPLY or len(message) != 3:
            raise ValueError(f"unexpected reply {header.name} with {len(message)} fields")
        request_id, reply = message[1], message[2]
        future = self.completion_futures.pop(request_id, None)
        submitted = self.request_submission_times.pop(request_id, None)
        if future is None:
            logger.warning("InferenceClient: reply for unknown request %r: %s", request_id,
                           reply.get("error") if isinstance(reply, dict) else reply)
            return
        if future.done():  # cancelled by the caller
            return
        if submitted is not None and isinstance(reply, dict):
            reply["latency"] = time.perf_counter() - submitted
        future.set_result(deserialize_request(reply) if self.deserialize else reply)

    def _connect_with_inference_coordinator(self, timeout_s: float) -> None:
        """CONNECT, then wait (at most ``timeout_s``) for CONNECT_ACK."""
        zmq = zmq_module()
        self.socket.send(pack([Headers.CONNECT.value]))
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if not self.socket.poll(remaining_ms, zmq.POLLIN):
                raise TimeoutError(f"InferenceClient: no CONNECT_ACK from the coordinator within {timeout_s} s")
            reply = unpack(self.socket.recv())
            if isinstance(reply, list) and reply and reply[0] == Headers.CONNECT_ACK.value:
                return
            logger.warning("InferenceClient: ignoring %r while waiting for CONNECT_ACK", reply)

    def start(self, loop: asyncio.AbstractEventLoop | None = None, *, connect_timeout_s: float = 60.0) -> None:
        """Handshake with the coordinator (``TimeoutError`` after ``connect_timeout_s``) and start reading replies."""
        self._loop = get_asyncio_loop(loop)
        self._connect_with_inference_coordinator(connect_timeout_s)
        self.listener_task = self._loop.create_task(self._recv_task())

    def _send_signal_to_engines(self, signal: Any, *args: Any) -> None:
        """Send a control header (and its arguments) to the coordinator."""
        self.socket.send(pack([signal.value, *args]))

    def pause_engines(self) -> None:
        """PAUSE every engine (they stop stepping; requests keep their state). Await ``engine.wait_until(PAUSED)``."""
        self._send_signal_to_engines(Headers.PAUSE)

    def unpause_engines(self) -> None:
        """UNPAUSE every engine (valid when paused)."""
        self._send_signal_to_engines(Headers.UNPAUSE)

    def suspend_engines(self) -> None:
        """SUSPEND every engine (valid when paused)."""
        self._send_signal_to_engines(Headers.SUSPEND)

    def resume_engines(self) -> None:
        """RESUME every engine (valid when suspended; they return to paused)."""
        self._send_signal_to_engines(Headers.RESUME)

    def stop_engines(self) -> None:
        """STOP every engine (valid when paused or suspended); the coordinator keeps running."""
        self._send_signal_to_engines(Headers.STOP)

    def set_generation_epoch(self, generation_epoch: int) -> None:
        """Tell every engine the current generation (policy) epoch."""
        self._send_signal_to_engines(Headers.SET_GENERATION_EPOCH, generation_epoch)

    def start_cuda_profiler(self) -> None:
        """Ask every engine to start the CUDA profiler (``cudaProfilerStart``; nothing on CPU)."""
        self._send_signal_to_engines(Headers.START_CUDA_PROFILER)

    def stop_cuda_profiler(self) -> None:
        """Ask every engine to stop the CUDA profiler."""
        self._send_signal_to_engines(Headers.STOP_CUDA_PROFILER)

    def shutdown_coordinator(self) -> None:
        """Tell the coordinator to exit (the engines are not told)."""
        self._send_signal_to_engines(Headers.SHUTDOWN)

    def stop(self) -> None:
        """Cancel the reply task and every unresolved future, close the socket and the context."""
        if self.listener_task is not None and not self.listener_task.done():
            self.listener_task.cancel()
        for future in self.completion_futures.values():
            if not future.done():
                future.cancel()
        self.completion_futures.clear()
        self.socket.close(linger=0)
        self.context.term()
