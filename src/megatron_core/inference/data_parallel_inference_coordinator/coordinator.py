"""The data-parallel inference coordinator (Megatron-Core's ``DataParallelInferenceCoordinator``).

One ZMQ ROUTER socket serves everybody. Engines (the tensor-rank-0, pipeline-rank-0 process of
each data-parallel replica) register by sending an empty message; clients
(:class:`~megatron_core.inference.inference_client.InferenceClient`) send CONNECT, then requests and
control signals. The coordinator gives each request a coordinator-wide id, routes it to an engine
(:mod:`.routing`), sends each finished request back to the client that asked for it, and forwards
control signals to every engine (:mod:`.state`). Messages are msgpack arrays ``[header, ...]``
(:mod:`megatron_core.inference.headers`); :mod:`.handlers` holds one function per header.

Nothing a peer sends stops the loop: a message that cannot be read, or a request that cannot be
routed, is answered with a finished request of status ``FAILED`` whose ``error`` says why; an
engine that disconnects fails the requests it held the same way. Unlike Megatron-Core, the socket
binds to 127.0.0.1 unless a ``hostname`` is given.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from megatron_core.inference._zmq import bind_socket, pack, unpack, zmq_module
from megatron_core.inference.config import PrefixCachingCoordinatorPolicy
from megatron_core.inference.headers import Headers, UnknownHeaderError, decode_header
from megatron_core.inference.inference_request import compute_block_hashes_batched

from .handlers import HANDLERS, BadMessageError, failure_reply
from .routing import EngineRouter
from .state import CoordinatorState

__all__ = ["DataParallelInferenceCoordinator"]

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often the loop looks at its stop event while no message arrives
_CLOSE_LINGER_MS = 200  # replies still queued at shutdown get this long to leave


class DataParallelInferenceCoordinator:
    """Routes client requests to data-parallel engines and their results back (see the module docstring).

    The constructor binds the socket, sends its address down ``pipe_connection`` (if given) and waits
    until ``data_parallel_size`` engines have registered (more may register later); :meth:`start`
    runs the loop until a client sends SHUTDOWN; :meth:`stop` closes the socket.

    Attributes:
        router_socket: the ROUTER socket. addr: its ``tcp://host:port`` address.
        request_id_to_client_id / request_id_to_client_request_id / request_id_to_rank: where each
            in-flight request (by coordinator id) came from and which engine holds it.
        known_clients: identities that sent CONNECT. state: the :class:`CoordinatorState`.
    """

    CoordinatorState = CoordinatorState

    def __init__(
        self,
        pipe_connection: Connection | None,
        data_parallel_size: int,
        tokenizer: Any,
        max_requests: int,
        inference_coordinator_port: int | None = None,
        deterministic_mode: bool = False,
        block_size_tokens: int | None = None,
        enable_prefix_caching: bool = False,
        prefix_caching_coordinator_policy: PrefixCachingCoordinatorPolicy = (
            PrefixCachingCoordinatorPolicy.FIRST_PREFIX_BLOCK
        ),
        prefix_caching_routing_alpha: float = 0.5,
        schedule_output_path: str | None = None,
        hostname: str | None = None,
        *,
        connect_timeout_s: float | None = None,
        stop_event: Any = None,
    ) -> None:
        _validate(data_parallel_size, max_requests, block_size_tokens, enable_prefix_caching,
                  prefix_caching_routing_alpha)
        zmq = zmq_module()
        self.data_parallel_size = data_parallel_size
        self.tokenizer = tokenizer
        self.max_requests = max_requests
        self.block_size_tokens = block_size_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_caching_coordinator_policy = PrefixCachingCoordinatorPolicy(prefix_caching_coordinator_policy)
        self.prefix_caching_routing_alpha = prefix_caching_routing_alpha
        self.schedule_output_path = schedule_output_path
        self.schedule_records: list[dict] | None = [] if schedule_output_path else None
        self.router = EngineRouter(max_requests, self.prefix_caching_coordinator_policy, prefix_caching_routing_alpha,
                                   enable_prefix_caching)
        self.request_id_to_client_id: dict[int, bytes] = {}
        self.request_id_to_client_request_id: dict[int, Any] = {}
        self.request_id_to_rank: dict[int, bytes] = {}
        self.next_request_id = 0
        self.known_clients: set[bytes] = set()
        self.state = CoordinatorState.RUNNING
        self._handlers = dict(HANDLERS)
        self._stop_event = stop_event if stop_event is not None else threading.Event()
        self._closed = False

        self.context = zmq.Context()
        self.router_socket = self.context.socket(zmq.ROUTER)
        self.router_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a peer that left raises
        self.router_socket.setsockopt(zmq.LINGER, 0)
        self.router_socket.setsockopt(zmq.SNDHWM, 0)
        self.router_socket.setsockopt(zmq.RCVHWM, 0)
        self._poller = zmq.Poller()
        self._poller.register(self.router_socket, zmq.POLLIN)
        try:
            self.addr = bind_socket(self.router_socket, hostname, inference_coordinator_port)
            if pipe_connection is not None:
                pipe_connection.send(self.addr)
                pipe_connection.close()
            self._wait_for_engines(data_parallel_size, connect_timeout_s)
        except BaseException:
            self.stop()
            raise
        if deterministic_mode:
            self.router.sort()

    # ---- engines ----------------------------------------------------------------------------------

    @property
    def identities_of_data_parallel_ranks(self) -> list[bytes]:
        """The registered engines' ZMQ identities, in routing order."""
        return list(self.router.identities)

    def _wait_for_engines(self, count: int, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(self.router.identities) < count:
            if self._stop_event.is_set():
                raise RuntimeError("the coordinator was stopped while waiting for engines")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"DataParallelInferenceCoordinator: {len(self.router.identities)} of "
                                   f"data_parallel_size ({count}) engines registered within {timeout_s} s")
            self._poll_once()
        logger.info("inference coordinator: %d engine(s) registered at %s", len(self.router.identities), self.addr)

    def _register_rank_identity(self, identity: bytes) -> None:
        """Add an engine (an empty message from ``identity``) to the routing pool."""
        if self.router.add(identity):
            logger.info("inference coordinator: engine %r registered (%d now)", identity, len(self.router.identities))

    def _remove_engine(self, identity: bytes, reason: str = "disconnected") -> None:
        """Drop an engine and fail, to their clients, the requests it still held."""
        self.router.remove(identity)
        orphans = [rid for rid, ident in self.request_id_to_rank.items() if ident == identity]
        for request_id in orphans:
            self.fail_request(request_id, f"inference engine {identity.decode(errors='replace')} {reason} before the "
                                          "request finished")
        logger.warning("inference coordinator: engine %r %s (%d left, %d requests failed)", identity, reason,
                       len(self.router.identities), len(orphans))

    def get_least_loaded_data_parallel_rank(self) -> bytes:
        """The engine with the fewest requests in flight (lowest routing index on a tie)."""
        return self.router.least_loaded()

    def get_best_data_parallel_rank(self, request_hashes: list[int]) -> bytes:
        """The engine for a request with these prompt-block hashes (see :mod:`.routing`)."""
        return self.router.best(request_hashes)

    def compute_request_hashes(self, prompt: str | list[int]) -> list[int]:
        """The prompt's block hashes when prefix-aware routing is on (a string prompt needs the tokenizer),
        else ``[]``."""
        if not self.router.uses_hashes():
            return []
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return []
            prompt = self.tokenizer.tokenize(prompt)
        return compute_block_hashes_batched(list(prompt), self.block_size_tokens)

    def _send_to_engine(self, identity: bytes, payload: bytes) -> bool:
        """Send to an engine; an engine that is gone is removed (its requests fail) and ``False`` returned."""
        zmq = zmq_module()
        try:
            self.router_socket.send_multipart([identity, payload])
            return True
        except zmq.error.ZMQError as error:
            if error.errno != zmq.EHOSTUNREACH:
                raise
            self._remove_engine(identity, "became unreachable")
            return False

    def _broadcast_to_engines(self, payload: list) -> None:
        """Send one message (a msgpack array) to every engine."""
        data = pack(payload)
        for identity in list(self.router.identities):
            self._send_to_engine(identity, data)

    # ---- clients ----------------------------------------------------------------------------------

    def send_to_client(self, identity: bytes, payload: list) -> None:
        """Send a message to a client; one that has gone away is forgotten."""
        zmq = zmq_module()
        try:
            self.router_socket.send_multipart([identity, pack(payload)])
        except zmq.error.ZMQError as error:
            if error.errno != zmq.EHOSTUNREACH:
                raise
            self.known_clients.discard(identity)
            logger.warning("inference coordinator: client %r is gone; dropping its reply", identity)

    def fail_request(self, request_id: int, message: str) -> None:
        """Finish an in-flight request as FAILED (``message`` in its ``error``) and tell its client."""
        client = self.request_id_to_client_id.pop(request_id, None)
        client_request_id = self.request_id_to_client_request_id.pop(request_id, None)
        engine = self.request_id_to_rank.pop(request_id, None)
        if engine is not None:
            self.router.finish(engine)
        if client is not None:
            self.send_to_client(client, [Headers.ENGINE_REPLY.value, client_request_id,
                                         failure_reply(request_id, message)])

    def detokenize(self, finished_request: dict) -> None:
        """Fill ``generated_text`` of a finished request (a serialized dict) with the coordinator's tokenizer."""
        finished_request["generated_text"] = self.tokenizer.detokenize(list(finished_request.get("generated_tokens")
                                                                            or []))

    # ---- the loop ---------------------------------------------------------------------------------

    def _poll_once(self) -> bool:
        """Handle at most one message; ``True`` when a handler asks the loop to end."""
        if not self._poller.poll(_POLL_MS):
            return False
        return self._dispatch(self.router_socket.recv_multipart())

    def _dispatch(self, frames: list[bytes]) -> bool:
        if len(frames) != 2:
            if frames:
                self._answer_bad_message(frames[0], None, BadMessageError(
                    f"a message must be one frame, got {len(frames) - 1}"))
            return False
        sender, data = frames
        if data == b"":
            self._register_rank_identity(sender)
            return False
        payload = None
        try:
            payload = unpack(data)
            if not isinstance(payload, list) or not payload:
                raise BadMessageError(f"a message must be a msgpack array [header, ...], got {type(payload).__name__}")
            header = decode_header(payload[0])
            handler = self._handlers.get(header)
            if handler is None:
                raise BadMessageError(f"the coordinator does not accept {header.name} messages")
            return bool(handler(self, sender, payload))
        except (ValueError, UnknownHeaderError, BadMessageError) as error:
            self._answer_bad_message(sender, payload, error)
        except Exception as error:  # noqa: BLE001 - a peer's message must never end the coordinator
            logger.exception("inference coordinator: handling a message from %r failed", sender)
            self._answer_bad_message(sender, payload, error)
        return False

    def _answer_bad_message(self, sender: bytes, payload: Any, error: BaseException) -> None:
        message = f"bad message: {type(error).__name__}: {error}"
        if sender in self.router.pending:
            logger.error("inference coordinator: engine %r sent a %s", sender, message)
            return
        client_request_id = None
        if isinstance(payload, list) and len(payload) > 1 and isinstance(payload[1], (int, str)):
            client_request_id = payload[1]
        logger.warning("inference coordinator: client %r sent a %s", sender, message)
        self.send_to_client(sender, [Headers.ENGINE_REPLY.value, client_request_id, failure_reply(None, message)])

    def start(self) -> None:
        """Serve messages until a client sends SHUTDOWN (or the stop event is set); then fail what is in flight."""
        while not self._stop_event.is_set():
            if self._poll_once():
                break
        for request_id in list(self.request_id_to_client_id):
            self.fail_request(request_id, "the inference coordinator shut down before the request finished")

    def request_stop(self) -> None:
        """Ask :meth:`start`'s loop to end within ~0.1 s (thread-safe)."""
        self._stop_event.set()

    def stop(self) -> None:
        """Write the schedule record (if asked for) and close the socket and context (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.schedule_output_path and self.schedule_records:
            with open(self.schedule_output_path, "w") as f:
                json.dump({"policy": self.prefix_caching_coordinator_policy.value,
                           "data_parallel_size": self.data_parallel_size,
                           "num_requests": len(self.schedule_records), "records": self.schedule_records}, f, indent=2)
        self.router_socket.close(linger=_CLOSE_LINGER_MS)
        self.context.term()

    @classmethod
    def entrypoint(cls, pipe_connection: Connection | None, ready_event: Any, *args: Any, **kwargs: Any) -> None:
        """Build a coordinator (the constructor's arguments after ``pipe_connection``), set ``ready_event`` once its
        engines registered, serve until SHUTDOWN, close.

        The target of the process (or thread) an engine launches; the address goes back through
        ``pipe_connection``.
        """
        coordinator = cls(pipe_connection, *args, **kwargs)
        ready_event.set()
        try:
            coordinator.start()
        except KeyboardInterrupt:
            logger.info("inference coordinator interrupted")
        finally:
            coordinator.stop()


def _validate(data_parallel_size: int, max_requests: int, block_size_tokens: int | None,
              enable_prefix_caching: bool, alpha: float) -> None:
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 0:
        raise ValueError(f"DataParallelInferenceCoordinator: data_parallel_size ({data_parallel_size!r}) must be an "
                         "int >= 0")
    if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests <= 0:
        raise ValueError(f"DataParallelInferenceCoordinator: max_requests ({max_requests!r}) must be an int > 0")
    if enable_prefix_caching and (block_size_tokens is None or block_size_tokens < 1):
        raise ValueError(f"DataParallelInferenceCoordinator: enable_prefix_caching needs block_size_tokens >= 1 "
                         f"(got {block_size_tokens!r})")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"DataParallelInferenceCoordinator: prefix_caching_routing_alpha ({alpha}) must be in [0, 1]")
