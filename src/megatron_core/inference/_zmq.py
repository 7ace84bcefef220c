"""The one place the inference coordinator's optional dependencies, pyzmq and msgpack, are imported.

Coordinator, client and engine link all reach ZMQ and msgpack through this module, so importing
``megatron_core`` never needs them; the first use raises an ``ImportError`` that names the
``coordinator`` extra. Messages are msgpack (never pickle): decoding one builds only plain
values (ints, floats, strings, bytes, lists, dicts), whatever a peer sends.
"""

from __future__ import annotations

import errno
import logging
from enum import Enum
from typing import Any

import numpy as np

__all__ = ["INSTALL_HINT", "LOOPBACK", "bind_socket", "msgpack_module", "pack", "unpack", "zmq_module"]

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'megatron-core-lite[coordinator]'"
LOOPBACK = "127.0.0.1"  # where sockets bind unless the caller names a host


def zmq_module() -> Any:
    """The ``zmq`` module (pyzmq), or an ``ImportError`` naming the extra that installs it."""
    try:
        import zmq
    except ImportError as error:
        raise ImportError(f"the inference coordinator needs pyzmq: {INSTALL_HINT}") from error
    return zmq


def msgpack_module() -> Any:
    """The ``msgpack`` module, or an ``ImportError`` naming the extra that installs it."""
    try:
        import msgpack
    except ImportError as error:
        raise ImportError(f"the inference coordinator needs msgpack: {INSTALL_HINT}") from error
    return msgpack


def _plain(obj: Any) -> Any:
    """msgpack's fallback for values it cannot encode itself: tensors and arrays become lists, enums names."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Enum):
        return obj.name
    if type(obj).__module__.startswith("torch") and hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"cannot send a {type(obj).__name__} to the inference coordinator")


def pack(obj: Any) -> bytes:
    """``obj`` as one msgpack message."""
    return msgpack_module().packb(obj, use_bin_type=True, default=_plain)


def unpack(data: bytes) -> Any:
    """The value of one msgpack message; raises ``ValueError`` (never anything else) when it is not one."""
    msgpack = msgpack_module()
    try:
        return msgpack.unpackb(data, raw=False)
    except Exception as error:  # noqa: BLE001 - msgpack raises several types for bad input
        raise ValueError(f"not a msgpack message ({type(error).__name__}: {error})") from error


def bind_socket(socket: Any, host: str | None, port: int | None) -> str:
    """Bind ``socket`` on ``host`` (default 127.0.0.1) and ``port``; return the bound ``tcp://`` address.

    ``port`` 0 or ``None`` picks a free port. A port that is taken falls back to a free one with a
    warning (as Megatron-Core's coordinator does); the returned address names the port in use.
    """
    zmq = zmq_module()
    host = host or LOOPBACK
    if port:
        try:
            socket.bind(f"tcp://{host}:{int(port)}")
            return socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.error.ZMQError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            logger.warning("port %s on %s is in use; binding to a free port instead", port, host)
    socket.bind_to_random_port(f"tcp://{host}")
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)
