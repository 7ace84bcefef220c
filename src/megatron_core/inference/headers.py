"""Message headers of the inference coordinator protocol (Megatron-Core's ``inference.headers``).

Every message between clients, the :class:`DataParallelInferenceCoordinator` and engines starts
with one header, sent as its integer value. Headers come in five categories, each an ``IntEnum``
over its own range of values (0, 20, 40, 60, 80, ...), so no two headers share a value; the
values are Megatron-Core 0.19's, so our processes and theirs read each other's headers.
:func:`decode_header` turns a value back into its member; :data:`Headers` looks a header up by
name (``Headers.PAUSE``) or by value (``Headers(40)``) across all categories.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import IntEnum

__all__ = ["HEADER_ENUMS", "Connection", "Control", "Headers", "Lifecycle", "Request", "Transport",
           "UnknownHeaderError", "decode_header"]


class Connection(IntEnum):
    """A client's handshake with the coordinator."""

    CONNECT = 0
    CONNECT_ACK = 1


class Request(IntEnum):
    """A request going to an engine, and the finished requests coming back."""

    SUBMIT_REQUEST = 20
    ENGINE_REPLY = 21


class Control(IntEnum):
    """Signals a client sends to every engine through the coordinator."""

    PAUSE = 40
    UNPAUSE = 41
    SUSPEND = 42
    RESUME = 43
    SET_GENERATION_EPOCH = 44
    STOP = 45
    START_CUDA_PROFILER = 46
    STOP_CUDA_PROFILER = 47


class Lifecycle(IntEnum):
    """An engine leaving, the coordinator being told to exit."""

    DISCONNECT = 60
    SHUTDOWN = 61


class Transport(IntEnum):
    """Framing of the messages an engine's leader rank forwards to its model-parallel peers."""

    TP_BROADCAST = 80


HEADER_ENUMS = (Connection, Request, Control, Lifecycle, Transport)
"""Every header category; a new category is a new ``IntEnum`` over an unused range, appended here."""


class UnknownHeaderError(Exception):
    """A message carried a header value (or a header) that no category defines."""

    def __init__(self, header: object) -> None:
        super().__init__(f"unknown message header {header!r}")
        self.header = header


def _index() -> tuple[dict[int, IntEnum], dict[str, IntEnum]]:
    by_value: dict[int, IntEnum] = {}
    by_name: dict[str, IntEnum] = {}
    for category in HEADER_ENUMS:
        for member in category:
            for table, key in ((by_value, member.value), (by_name, member.name)):
                if key in table:
                    raise ValueError(f"headers {table[key]!r} and {member!r} share {key!r}")
                table[key] = member
    return by_value, by_name


_BY_VALUE, _BY_NAME = _index()


def decode_header(value: object) -> IntEnum:
    """The header member whose wire value is ``value``; :class:`UnknownHeaderError` if there is none."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnknownHeaderError(value)
    try:
        return _BY_VALUE[int(value)]
    except KeyError:
        raise UnknownHeaderError(value) from None


class _Headers:
    """Every header under one name: ``Headers.STOP`` is ``Control.STOP``; ``Headers(45)`` decodes a value."""

    def __call__(self, value: object) -> IntEnum:
        return decode_header(value)

    def __getattr__(self, name: str) -> IntEnum:
        try:
            return _BY_NAME[name]
        except KeyError:
            raise AttributeError(f"no message header named {name!r}") from None

    def __iter__(self) -> Iterator[IntEnum]:
        return iter(_BY_NAME.values())


Headers = _Headers()
"""All header categories as one namespace (attribute lookup by name, call to decode a value)."""
