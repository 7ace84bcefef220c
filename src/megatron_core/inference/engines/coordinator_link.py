"""A dynamic engine serving requests from the data-parallel inference coordinator (Megatron-Core's
``DynamicInferenceEngine.start_listening_to_data_parallel_coordinator`` and ``run_engine_with_coordinator``).

Roles: in each data-parallel replica the rank with tensor- and pipeline-parallel rank 0 (the *MP
leader*) holds a ZMQ DEALER socket to the coordinator; data-parallel rank 0's leader also launches
the coordinator (a spawned process, or a thread when this process is a daemon and cannot have
children). Every loop iteration the leader drains its socket and hands the messages to its
model-parallel peers with ``torch.distributed`` broadcasts over the model-parallel group (a
length, then the msgpack bytes as a uint8 tensor; Megatron-Core uses a ZMQ PUB/SUB pair), so every
rank of the replica adds the same requests and applies the same control signal in the same
iteration, then takes the same step. Only the leader replies to the coordinator.

Control signals follow Megatron-Core's engine states: PAUSE -> PAUSING -> PAUSED, UNPAUSE ->
UNPAUSING -> RUNNING, SUSPEND -> SUSPENDING -> SUSPENDED, RESUME -> RESUMING -> PAUSED (RESUMED
marked), STOP -> STOPPING -> STOPPED; each ``-ING`` state ends at a barrier over all ranks. A
paused engine keeps its requests and takes no steps; SUSPEND and RESUME also call the engine's
``suspend()`` / ``resume()`` (KV cache freed, offloaded or kept per ``kv_cache_management_mode``).
On STOP the engine fails the requests it still holds, replies for them, sends DISCONNECT and
closes its sockets.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from megatron_core.inference._request_wire import deserialize_sampling_params
from megatron_core.inference._zmq import LOOPBACK, pack, unpack, zmq_module
from megatron_core.inference.data_parallel_inference_coordinator import DataParallelInferenceCoordinator
from megatron_core.inference.data_parallel_inference_coordinator.handlers import failure_reply
from megatron_core.inference.engines.async_zmq_communicator import broadcast_bytes
from megatron_core.inference.engines.fault_isolation import CANCELLED, describe
from megatron_core.inference.headers import Headers, UnknownHeaderError, decode_header

__all__ = ["CoordinatorLink", "start_listening_to_data_parallel_coordinator", "wait_until"]

logger = logging.getLogger(__name__)

_IDLE_SLEEP_S = 0.005
_LAUNCH_TIMEOUT_S = 300.0  # the coordinator's start, and its wait for every engine to register
_CLOSE_LINGER_MS = 1000  # replies and DISCONNECT queued at shutdown get this long to leave
STOPPED_ERROR = "the engine was stopped before the request finished"
_ENGINE_SIGNALS = (Headers.PAUSE, Headers.UNPAUSE, Headers.SUSPEND, Headers.RESUME, Headers.STOP)


def _stable_states(states: Any) -> tuple:
    """The states ``wait_until`` accepts, of the engine's ``EngineState`` enum ``states``."""
    return (states.RUNNING, states.PAUSED, states.SUSPENDED, states.RESUMED, states.STOPPED)


class _CoordinatorThread(threading.Thread):
    """The coordinator run on a daemon thread, with the ``join`` / ``is_alive`` / ``terminate`` of a process."""

    def __init__(self, kwargs: dict) -> None:
        self._stop_event = threading.Event()
        super().__init__(target=DataParallelInferenceCoordinator.entrypoint, kwargs={**kwargs,
                         "stop_event": self._stop_event}, name="inference-coordinator", daemon=True)

    def terminate(self) -> None:
        """Make the coordinator's loop end within ~0.1 s."""
        self._stop_event.set()


def _groups() -> tuple[Any, Any, int, int]:
    """``(data-parallel group, model-parallel group, tensor rank, pipeline rank)``; groups are ``None`` without
    ``torch.distributed``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, None, 0, 0
    from megatron_core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return dist.group.WORLD, None, 0, 0
    return (ps.get_data_parallel_group(), ps.get_model_parallel_group(), ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank())


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


async def _await(condition: Any, handle: Any, what: str, timeout_s: float = _LAUNCH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if handle is not None and not handle.is_alive():
            raise RuntimeError(f"the inference coordinator exited while {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the inference coordinator was not done {what} within {timeout_s} s")
        await asyncio.sleep(0.01)


class CoordinatorLink:
    """One engine's connection to the coordinator and the loop that serves it (see the module docstring)."""

    def __init__(self, engine: Any, hostname: str | None) -> None:
        self.engine = engine
        self.states = type(engine.state)  # EngineState, read off the engine (dynamic_engine imports this module)
        self.hostname = hostname or LOOPBACK
        self.dp_group, self.mp_group, tp_rank, pp_rank = _groups()
        self.dp_rank = 0 if self.dp_group is None else dist.get_rank(self.dp_group)
        self.is_mp_coordinator = tp_rank == 0 and pp_rank == 0
        self.is_dp_coordinator = self.is_mp_coordinator and self.dp_rank == 0
        self.events = {state: False for state in _stable_states(self.states)}
        self.events[self.states.RUNNING] = True
        self.pending_signals: deque[list] = deque()
        self.generation_epoch: int | None = None
        self.received_request_count = 0  # SUBMIT_REQUEST messages this engine got (accepted or refused)
        self.context: Any = None
        self.socket: Any = None
        self.coordinator_handle: Any = None

    # ---- setup ------------------------------------------------------------------------------------

    async def connect(self, port: int | None, launch: bool, schedule_output_path: str | None) -> str | None:
        """Launch (if asked) and join the coordinator; returns its address (``None`` on ranks that never need it)."""
        address, ready = None, None
        if launch and self.is_dp_coordinator:
            address, ready = await self._launch(port, schedule_output_path)
        elif not launch:
            if not port:
                raise ValueError("start_listening_to_data_parallel_coordinator: launch_inference_coordinator=False "
                                 f"needs the running coordinator's inference_coordinator_port (got {port!r})")
            address = f"tcp://{self.hostname}:{int(port)}"
        if _size(self.dp_group) > 1 and launch:
            shared = await asyncio.to_thread(broadcast_bytes, (address or "").encode(), self.dp_group)
            address = shared.decode() or None
        if self.is_mp_coordinator:
            zmq = zmq_module()
            self.context = zmq.Context()
            self.socket = self.context.socket(zmq.DEALER)
            self.socket.setsockopt(zmq.IDENTITY, f"mp-coord-{self.dp_rank}".encode())
            self.socket.setsockopt(zmq.SNDHWM, 0)
            self.socket.setsockopt(zmq.RCVHWM, 0)
            self.socket.connect(address)
            self.socket.send(b"")  # registers this engine
        if _size(self.mp_group) > 1:
            await asyncio.to_thread(dist.barrier, group=self.mp_group)
        if ready is not None:
            await _await(ready.is_set, self.coordinator_handle, "waiting for the engines to register")
        return address

    async def _launch(self, port: int | None, schedule_output_path: str | None) -> tuple[str, Any]:
        engine = self.engine
        config = engine.context.inference_config
        in_daemon = multiprocessing.current_process().daemon
        ctx = multiprocessing.get_context("spawn")
        parent_end, child_end = ctx.Pipe()
        ready = threading.Event() if in_daemon else ctx.Event()
        kwargs = dict(
            pipe_connection=child_end, ready_event=ready, data_parallel_size=_size(self.dp_group),
            tokenizer=engine.controller.tokenizer, max_requests=engine.context.max_requests,
            inference_coordinator_port=port, deterministic_mode=torch.are_deterministic_algorithms_enabled(),
            block_size_tokens=engine.context.block_size_tokens, enable_prefix_caching=engine.context.enable_prefix_caching,
            prefix_caching_coordinator_policy=config.prefix_caching_coordinator_policy,
            prefix_caching_routing_alpha=config.prefix_caching_routing_alpha,
            schedule_output_path=schedule_output_path, hostname=self.hostname, connect_timeout_s=_LAUNCH_TIMEOUT_S,
        )
        if in_daemon:
            handle = _CoordinatorThread(kwargs)
        else:
            handle = ctx.Process(target=DataParallelInferenceCoordinator.entrypoint, kwargs=kwargs,
                                 name="inference-coordinator", daemon=True)
        handle.start()
        self.coordinator_handle = handle
        await _await(lambda: parent_end.poll(0), handle, "binding its socket")
        address = parent_end.recv()
        parent_end.close()
        if port and not address.endswith(f":{int(port)}"):
            logger.warning("the inference coordinator asked for port %s but bound %s", port, address)
        return address, ready

    # ---- the loop ---------------------------------------------------------------------------------

    async def _receive(self) -> list[bytes]:
        messages: list[bytes] = []
        if self.is_mp_coordinator:
            zmq = zmq_module()
            while True:
                try:
                    messages.append(self.socket.recv(flags=zmq.NOBLOCK))
                except zmq.Again:
                    break
        if _size(self.mp_group) > 1:
            data = pack([Headers.TP_BROADCAST.value, messages]) if self.is_mp_coordinator else None
            messages = unpack(await asyncio.to_thread(broadcast_bytes, data, self.mp_group))[1]
        return messages

    def _apply(self, messages: list[bytes]) -> None:
        """Add the requests; queue the control signals (one is applied per iteration)."""
        for raw in messages:
            try:
                payload = unpack(raw)
                header = decode_header(payload[0])
            except (ValueError, UnknownHeaderError, TypeError, IndexError, KeyError) as error:
                logger.error("engine: dropping an unreadable coordinator message: %s", error)
                continue
            if header == Headers.SUBMIT_REQUEST:
                self._add_request(payload)
            elif header == Headers.SET_GENERATION_EPOCH:
                self.generation_epoch = payload[1]
                self.engine._generation_epoch = payload[1]
            elif header in (Headers.START_CUDA_PROFILER, Headers.STOP_CUDA_PROFILER):
                if torch.cuda.is_available():
                    profiler = torch.cuda.cudart()
                    (profiler.cudaProfilerStart if header == Headers.START_CUDA_PROFILER else profiler.cudaProfilerStop)()
            elif header in _ENGINE_SIGNALS:
                self.pending_signals.append(payload)
            else:
                logger.error("engine: dropping a %s message, which engines do not take", header.name)
        if self.pending_signals:
            self._apply_signal(decode_header(self.pending_signals.popleft()[0]))

    def _add_request(self, payload: list) -> None:
        request_id = payload[1] if len(payload) > 1 else None
        prompt = payload[2] if len(payload) > 2 else None
        self.received_request_count += 1
        try:
            if len(payload) != 4:
                raise ValueError(f"SUBMIT_REQUEST has {len(payload)} fields, expected 4")
            self.engine.add_request(request_id, prompt, deserialize_sampling_params(payload[3]))
        except Exception as error:  # noqa: BLE001 - a refused request is answered, never raised
            self._send_replies([failure_reply(request_id, f"request refused: {describe(error)}", prompt)])

    def _apply_signal(self, header: Any) -> None:
        s, engine = self.states, self.engine
        if header == Headers.PAUSE:
            if engine.state == s.RUNNING:
                engine.state = s.PAUSING
                self.events[s.RUNNING] = False
            return
        rules = {Headers.UNPAUSE: ((s.PAUSED,), s.UNPAUSING), Headers.SUSPEND: ((s.PAUSED,), s.SUSPENDING),
                 Headers.RESUME: ((s.SUSPENDED,), s.RESUMING), Headers.STOP: ((s.PAUSED, s.SUSPENDED), s.STOPPING)}
        allowed, new_state = rules[header]
        if engine.state not in allowed:
            logger.warning("engine: ignoring %s in state %s", header.name, engine.state.name)
            return
        if header == Headers.SUSPEND:
            self.events[s.RESUMED] = False
            engine.suspend()
        if engine.state == s.SUSPENDED:  # RESUME or STOP
            self.events[s.SUSPENDED] = False
        if header == Headers.RESUME:
            engine.resume()
        engine.state = new_state

    async def _barrier(self) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            await asyncio.to_thread(dist.barrier)

    async def _settle(self) -> bool:
        """Finish a transitional state after the barrier; ``True`` when the loop should end."""
        s, engine = self.states, self.engine
        state = engine.state
        await self._barrier()
        if state == s.PAUSING:
            engine.state = s.PAUSED
            self.events[s.PAUSED] = True
        elif state == s.UNPAUSING:
            engine.state = s.RUNNING
            self.events[s.PAUSED] = False
            self.events[s.RUNNING] = True
        elif state == s.SUSPENDING:
            engine.state = s.SUSPENDED
            self.events[s.SUSPENDED] = True
        elif state == s.RESUMING:
            engine.state = s.PAUSED
            self.events[s.RESUMED] = True
        return state == s.STOPPING

    async def run(self) -> None:
        """Receive, apply, step; until STOP (or an error), then shut down."""
        s, engine = self.states, self.engine
        engine.use_coordinator = True
        try:
            while True:
                self._apply(await self._receive())
                if engine.state == s.RUNNING:
                    if engine.has_unfinished_requests():
                        result = await asyncio.to_thread(engine.step_modern)
                        self._reply(result["finished_request_records"])
                        if engine.failure is not None:
                            break
                    else:
                        await asyncio.sleep(_IDLE_SLEEP_S)
                elif engine.state in (s.PAUSED, s.SUSPENDED):
                    await asyncio.sleep(_IDLE_SLEEP_S)
                elif await self._settle():
                    break
        except Exception:
            logger.exception("engine: the coordinator loop failed; shutting the engine down")
            raise
        finally:
            await self._shutdown()

    # ---- replies and shutdown ---------------------------------------------------------------------

    def _reply(self, records: list, error: str | None = None) -> None:
        replies = []
        for record in records:
            request = record.merge()
            if error is not None and request.error == CANCELLED:
                request.error = error
            try:
                serialized = request.serialize()
                pack(serialized)
            except (TypeError, ValueError) as pack_error:
                serialized = failure_reply(request.request_id, f"the finished request cannot be sent: {pack_error}")
            replies.append(serialized)
        self._send_replies(replies)

    def _send_replies(self, replies: list[dict]) -> None:
        if replies and self.is_mp_coordinator and self.socket is not None:
            self.socket.send(pack([Headers.ENGINE_REPLY.value, replies]))

    async def _shutdown(self) -> None:
        s, engine = self.states, self.engine
        try:
            with engine._inbox_lock:
                pending = [r.request_id for r in engine._inbox] + list(engine.requests)
            if pending:
                for request_id in pending:
                    engine.cancel_request(request_id)
                result = await asyncio.to_thread(engine.step_modern)
                self._reply(result["finished_request_records"], STOPPED_ERROR)
        finally:
            if self.socket is not None:
                try:
                    self.socket.send(pack([Headers.DISCONNECT.value]))
                finally:
                    self.socket.close(linger=_CLOSE_LINGER_MS)
                    self.socket = None
            if self.context is not None:
                self.context.term()
                self.context = None
            engine.state = s.STOPPED
            self.events[s.STOPPED] = True

    async def wait_until(self, state: Any) -> None:
        """Return once ``state`` (a stable state: RUNNING, PAUSED, SUSPENDED, RESUMED, STOPPED) is marked."""
        while not self.events[state]:
            await asyncio.sleep(_IDLE_SLEEP_S)


async def start_listening_to_data_parallel_coordinator(
    engine: Any, inference_coordinator_port: int | None = None, launch_inference_coordinator: bool = True, *,
    hostname: str | None = None, coordinator_schedule_output_path: str | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
) -> str | None:
    """Connect ``engine`` to the coordinator (launching it first if asked) and start serving on ``loop``.

    A collective: every rank of the job calls it. Returns the coordinator's address on the ranks that
    know it (every data-parallel rank's MP leader, and all ranks when ``launch_inference_coordinator``
    is False). ``hostname`` is where sockets bind and connect (default 127.0.0.1); port 0 or ``None``
    picks a free port.
    """
    from megatron_core._ground.async_utils import get_asyncio_loop

    if getattr(engine, "_coordinator_link", None) is not None:
        raise RuntimeError("this engine is already listening to an inference coordinator")
    engine.state = type(engine.state).RUNNING
    link = CoordinatorLink(engine, hostname)
    address = await link.connect(inference_coordinator_port, launch_inference_coordinator,
                                 coordinator_schedule_output_path)
    engine._coordinator_link = link
    engine.is_mp_coordinator = link.is_mp_coordinator
    engine.is_dp_coordinator = link.is_dp_coordinator
    engine.inference_coordinator_process = link.coordinator_handle
    engine.engine_loop_task = get_asyncio_loop(loop).create_task(link.run())
    return address


async def wait_until(engine: Any, state: Any) -> None:
    """Wait until ``engine`` reaches the stable ``state`` (``ValueError`` for a transitional one)."""
    stable = _stable_states(type(engine.state))
    if state not in stable:
        raise ValueError(f"wait_until: {state} is transitional; wait for one of {', '.join(s.name for s in stable)}")
    link = getattr(engine, "_coordinator_link", None)
    if link is not None:
        await link.wait_until(state)
        return
    while engine.state != state:
        await asyncio.sleep(_IDLE_SLEEP_S)
