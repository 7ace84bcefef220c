"""Start and stop the coordinator-fed text-generation server (Megatron-Core's ``dynamic_text_gen_server.
text_generation_server``).

:func:`start_text_gen_server` binds one listening socket (127.0.0.1 unless ``hostname`` says
otherwise; or the caller's bound ``sock``) and starts ``num_replicas`` frontend replicas on it.
Each replica is a daemon thread with its own event loop, its own :class:`InferenceClient`
connected to the coordinator, and a uvicorn server of the FastAPI app built from
:data:`~.endpoints.ROUTES` (FastAPI and uvicorn are the ``server`` extra, imported through
:func:`~megatron_core.inference.text_generation_server.deps.require_server_deps`). Megatron-Core
runs each replica in its own process (Quart + hypercorn); ours share this process, so the
tokenizer is not pickled and :func:`stop_text_gen_server` leaves no process behind. Every error is
a JSON body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx or 5xx status.
"""

# No ``from __future__ import annotations``: FastAPI must see the real ``Request`` class in the endpoint signatures.
import asyncio
import json
import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from megatron_core.inference.engines.fault_isolation import describe
from megatron_core.inference.inference_client import InferenceClient
from megatron_core.inference.text_generation_server.deps import require_server_deps
from megatron_core.inference.text_generation_server.dynamic_text_gen_server.endpoints import ROUTES, Route
from megatron_core.inference.text_generation_server.dynamic_text_gen_server.endpoints.common import (
    ServerState,
)
from megatron_core.inference.text_generation_server.protocol import APIError, error_body
from megatron_core.inference.text_generation_server.response_parsers import resolve_parsers

__all__ = ["bound_port", "build_app", "logger", "start_text_gen_server", "stop_text_gen_server", "temp_log_level"]

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # a replica's client handshake plus uvicorn's startup
STOP_TIMEOUT_S = 10.0

_REPLICAS: list["_Replica"] = []
_SHARED_SOCKET: socket.socket | None = None


@contextmanager
def temp_log_level(level: int, logger: logging.Logger | None = None) -> Iterator[None]:
    """Set ``logger``'s (default: the root logger's) level for the duration of the block."""
    target = logger or logging.getLogger()
    previous = target.level
    target.setLevel(level)
    try:
        yield
    finally:
        target.setLevel(previous)


def build_app(state: ServerState) -> Any:
    """The FastAPI app serving :data:`~.endpoints.ROUTES` over ``state``."""
    fastapi, _ = require_server_deps()
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = fastapi.FastAPI(title="Megatron Inference Server")

    @app.exception_handler(APIError)
    async def _api_error(_: Any, error: APIError) -> Any:
        return JSONResponse(error_body(error.status, error.message, error.param, error.code), error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Any, error: Any) -> Any:
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(error_body(error.status_code, message), error.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_: Any, error: Exception) -> Any:
        logger.error("request failed: %s", describe(error), exc_info=error)
        return JSONResponse(error_body(500, f"internal error: {describe(error)}", code="internal_error"), 500)

    def mount(route: Route) -> None:
        if route.takes_body:
            async def endpoint(request: fastapi.Request) -> Any:
                try:
                    body = json.loads(await request.body())
                except (ValueError, RecursionError) as error:
                    raise APIError(400, f"Invalid or missing JSON body: {describe(error)}") from error
                return await route.handler(state, body)
        else:
            async def endpoint() -> Any:
                status, payload = await route.handler(state)
                return JSONResponse(payload, status)
        for path in route.paths:
            app.add_api_route(path, endpoint, methods=[route.method])

    for route in ROUTES:
        mount(route)
    return app


class _Replica(threading.Thread):
    """One frontend: an event loop with its client and uvicorn server on a duplicate of the shared socket."""

    def __init__(self, index: int, coordinator_addr: str, tokenizer: Any, parsers: list[str], verbose: bool,
                 sock: socket.socket) -> None:
        super().__init__(name=f"text-gen-server-{index}", daemon=True)
        self.coordinator_addr, self.tokenizer, self.parsers, self.verbose = coordinator_addr, tokenizer, parsers, verbose
        self.sock = sock
        self.server: Any = None
        self.error: BaseException | None = None
        self.ready = threading.Event()

    def run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as error:  # noqa: BLE001 - reported to start_text_gen_server through self.error
            self.error = error
            logger.error("%s failed: %s", self.name, describe(error))
        finally:
            self.ready.set()

    async def _serve(self) -> None:
        _, uvicorn = require_server_deps()
        client = InferenceClient(self.coordinator_addr, deserialize=False)
        try:
            client.start(connect_timeout_s=START_TIMEOUT_S)
            app = build_app(ServerState(client, self.tokenizer, resolve_parsers(self.parsers or []), self.verbose))
            config = uvicorn.Config(app, log_level="info" if self.verbose else "warning", lifespan="off",
                                    timeout_graceful_shutdown=STOP_TIMEOUT_S / 2)
            self.server = uvicorn.Server(config)
            self.server.install_signal_handlers = lambda: None  # not the main thread
            serving = asyncio.create_task(self.server.serve(sockets=[self.sock]))
            while not self.server.started and not serving.done():
                await asyncio.sleep(0.01)
            self.ready.set()
            await serving
        finally:
            client.stop()
            self.sock.close()

    def stop(self) -> None:
        """Ask uvicorn to exit (the thread ends once open responses are done)."""
        if self.server is not None:
            self.server.should_exit = True


def _bind(hostname: str | None, server_port: int, sock: socket.socket | None) -> socket.socket:
    if sock is not None:
        if sock.getsockname()[1] == 0:
            raise ValueError("start_text_gen_server: sock must be bound to a real port (its port is 0)")
        listener = sock
    else:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((hostname or "127.0.0.1", server_port))
    listener.listen(2**12)
    listener.setblocking(False)
    return listener


def start_text_gen_server(coordinator_addr: str, tokenizer: Any, rank: int, server_port: int,
                          parsers: list[str] | None = None, verbose: bool = False, num_replicas: int = 4,
                          hostname: str | None = None, sock: socket.socket | None = None) -> None:
    """Serve on ``hostname:server_port`` (or ``sock``) with ``num_replicas`` replicas; returns once all are up.

    ``server_port=0`` picks a free port (:func:`bound_port` tells which). Raises ``ValueError`` for an
    unknown parser or ``num_replicas < 1``, and the replica's error if one fails to start.
    """
    global _SHARED_SOCKET
    if _REPLICAS:
        logger.warning("the text generation server is already running")
        return
    if num_replicas < 1:
        raise ValueError(f"start_text_gen_server: num_replicas ({num_replicas}) must be >= 1")
    resolve_parsers(parsers or [])
    require_server_deps()
    _SHARED_SOCKET = _bind(hostname, server_port, sock)
    for index in range(num_replicas):
        replica = _Replica(index, coordinator_addr, tokenizer, parsers or [], verbose, _SHARED_SOCKET.dup())
        replica.start()
        _REPLICAS.append(replica)
    for replica in _REPLICAS:
        if not replica.ready.wait(START_TIMEOUT_S) or replica.error is not None or not replica.is_alive():
            error = replica.error
            stop_text_gen_server()
            raise RuntimeError(f"rank {rank}: a text generation server replica did not start: "
                               f"{describe(error) if error is not None else 'timed out'}") from error
    host, port = _SHARED_SOCKET.getsockname()[:2]
    with temp_log_level(logging.INFO, logger):
        logger.info("rank %d: text generation server on http://%s:%d (%d replicas, tokenizer %s, parsers %s)",
                    rank, host, port, num_replicas, type(tokenizer).__name__, parsers)


def bound_port() -> int | None:
    """The port the running server listens on (``None`` when it is not running)."""
    return None if _SHARED_SOCKET is None else _SHARED_SOCKET.getsockname()[1]


def stop_text_gen_server() -> None:
    """Stop every replica, join their threads and close the listening socket (a no-op when not running)."""
    global _SHARED_SOCKET
    if not _REPLICAS and _SHARED_SOCKET is None:
        return
    for replica in _REPLICAS:
        replica.stop()
    for replica in _REPLICAS:
        replica.join(STOP_TIMEOUT_S)
        if replica.is_alive():
            logger.warning("%s did not stop within %s s", replica.name, STOP_TIMEOUT_S)
    _REPLICAS.clear()
    if _SHARED_SOCKET is not None:
        _SHARED_SOCKET.close()
        _SHARED_SOCKET = None
