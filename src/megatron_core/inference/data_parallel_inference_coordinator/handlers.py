"""One function per message header the coordinator accepts (Megatron-Core's ``coordinator handlers``).

``@message_handler(header, ...)`` records a function in :data:`HANDLERS`; the coordinator's loop
decodes a message's header and calls ``handler(coordinator, sender_identity, payload)`` with the
whole decoded message. A handler returns ``True`` to end the loop (only SHUTDOWN does). A handler
raises :class:`BadMessageError` for a message it cannot use; the loop answers the sender with a
failed request naming the problem.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from megatron_core.inference._zmq import pack
from megatron_core.inference.headers import Headers

from .state import CONTROL_TRANSITIONS, CoordinatorState

__all__ = ["HANDLERS", "BadMessageError", "failure_reply", "message_handler"]

logger = logging.getLogger(__name__)

Handler = Callable[[Any, bytes, list], "bool | None"]

HANDLERS: dict[Any, Handler] = {}
"""Header -> the function that handles it (filled by :func:`message_handler`)."""


class BadMessageError(ValueError):
    """A message whose fields do not fit its header."""


def message_handler(*headers: Any) -> Callable[[Handler], Handler]:
    """Register the decorated function as the handler of ``headers`` (each header at most once)."""

    def register(fn: Handler) -> Handler:
        for header in headers:
            if header in HANDLERS:
                raise ValueError(f"message_handler: {header!r} already has a handler ({HANDLERS[header].__name__})")
            HANDLERS[header] = fn
        return fn

    return register


def failure_reply(request_id: Any, message: str, prompt: Any = None) -> dict:
    """A serialized finished request of status FAILED (what an engine sends for a refused request)."""
    return {"request_id": request_id, "status": "FAILED", "error": message, "prompt": prompt if isinstance(prompt, str)
            else None, "generated_tokens": [], "generated_text": "", "finish_reason": "error"}


def _is_token_list(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


@message_handler(Headers.CONNECT)
def handle_connect(coordinator: Any, sender_identity: bytes, payload: list) -> None:
    """Acknowledge a client's CONNECT (again, for a client that repeats it)."""
    coordinator.known_clients.add(sender_identity)
    coordinator.send_to_client(sender_identity, [Headers.CONNECT_ACK.value])


@message_handler(Headers.SUBMIT_REQUEST)
def handle_submit_request(coordinator: Any, sender_identity: bytes, payload: list) -> None:
    """``[SUBMIT_REQUEST, client_request_id, prompt, sampling_params]``: give the request a coordinator id and
    send it to the engine :mod:`.routing` picks; a request nobody can take fails at once."""
    if len(payload) != 4:
        raise BadMessageError(f"SUBMIT_REQUEST is [header, client_request_id, prompt, sampling_params], got "
                              f"{len(payload)} fields")
    client_request_id, prompt, sampling_params = payload[1:]
    if sender_identity not in coordinator.known_clients:
        raise BadMessageError("the client sent SUBMIT_REQUEST before CONNECT")
    if not isinstance(prompt, str) and not _is_token_list(prompt):
        raise BadMessageError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if sampling_params is not None and not isinstance(sampling_params, dict):
        raise BadMessageError(f"sampling_params must be a map (SamplingParams.serialize()), got "
                              f"{type(sampling_params).__name__}")
    request_id = coordinator.next_request_id
    coordinator.next_request_id += 1
    coordinator.request_id_to_client_id[request_id] = sender_identity
    coordinator.request_id_to_client_request_id[request_id] = client_request_id
    hashes = coordinator.compute_request_hashes(prompt)
    data = pack([Headers.SUBMIT_REQUEST.value, request_id, prompt, sampling_params])
    while coordinator.router.identities:
        engine = coordinator.get_best_data_parallel_rank(hashes)
        if coordinator._send_to_engine(engine, data):
            coordinator.request_id_to_rank[request_id] = engine
            coordinator.router.assign(engine, hashes)
            if coordinator.schedule_records is not None:
                coordinator.schedule_records.append({"request_id": request_id, "num_hashes": len(hashes),
                                                     "rank_index": coordinator.router.identities.index(engine)})
            return
    coordinator.fail_request(request_id, "no inference engine is connected to the coordinator")


@message_handler(Headers.PAUSE, Headers.UNPAUSE, Headers.SUSPEND, Headers.RESUME, Headers.SET_GENERATION_EPOCH,
                 Headers.STOP)
def handle_control_signal(coordinator: Any, sender_identity: bytes, payload: list) -> None:
    """Apply a client's control signal to the coordinator's state (:data:`.state.CONTROL_TRANSITIONS`) and
    forward it, with its arguments, to every engine."""
    if sender_identity not in coordinator.known_clients:
        raise BadMessageError("the client sent a control signal before CONNECT")
    header = Headers(payload[0])
    if header == Headers.SET_GENERATION_EPOCH and (len(payload) != 2 or not isinstance(payload[1], int)):
        raise BadMessageError("SET_GENERATION_EPOCH is [header, epoch (int)]")
    transition = CONTROL_TRANSITIONS[header]
    if coordinator.state not in transition.allowed_from:
        if coordinator.state not in transition.idempotent_in:
            logger.warning("inference coordinator: ignoring %s in state %s", header.name, coordinator.state.name)
        return
    if transition.new_state is not None:
        coordinator.state = transition.new_state
    coordinator._broadcast_to_engines(payload)
    if header == Headers.STOP:  # the engines are gone; engines that register later start running
        coordinator.state = CoordinatorState.RUNNING


@message_handler(Headers.START_CUDA_PROFILER, Headers.STOP_CUDA_PROFILER)
def handle_cuda_profiler_signal(coordinator: Any, sender_identity: bytes, payload: list) -> None:
    """Forward a CUDA-profiler signal to every engine (no state change)."""
    if sender_identity not in coordinator.known_clients:
        raise BadMessageError("the client sent a profiler signal before CONNECT")
    coordinator._broadcast_to_engines([payload[0]])


@message_handler(Headers.ENGINE_REPLY)
def handle_engine_reply(coordinator: Any, sender_identity: bytes, payload: list) -> None:
    """``[ENGINE_REPLY, [finished request, ...]]`` from an engine: send each to the client that submitted it."""
    if sender_identity not in coordinator.router.pending:
        raise BadMessageError("ENGINE_REPLY comes from engines only")
    if len(payload) != 2 or not isinstance(payload[1], list):
        raise BadMessageError("ENGINE_REPLY is [header, [finished request, ...]]")
    for finished in payload[1]:
        request_id = finished.get("request_id") if isinstance(finished, dict) else None
        client = coordinator.request_id_to_client_id.pop(request_id, None)
        if client is None:
            logger.warning("inference coordinator: engine %r finished unknown request %r", sender_identity, request_id)
            continue
        client_request_id = coordinator.request_id_to_client_request_id.pop(request_id)
        coordinator.router.finish(coordinator.request_id_to_rank.pop(request_id, sender_identity))
        if finished.get("generated_text") is None and coordinator.tokenizer is not None:
            coordinator.detokenize(finished)
        coordinator.send_to_client(client, [Headers.ENGINE_REPLY.value, client_request_id, finished])


@message_handler(Headers.SHUTDOWN)
def handle_shutdown(coordinator: Any, sender_identity: bytes, payload: list) -> bool | None:
    """End the coordinator's loop (a known client's SHUTDOWN); the engines are not told."""
    if sender_identity not in coordinator.known_clients:
        raise BadMessageError("the client sent SHUTDOWN before CONNECT")
    return True


@message_handler(Headers.DISCONNECT)
def handle_disconnect(coordinator: Any, sender_identity: bytes, payload: list) -> None:
    """An engine leaves: it gets no more requests, and those it still held fail."""
    if sender_identity in coordinator.router.pending:
        coordinator._remove_engine(sender_identity, "disconnected")
