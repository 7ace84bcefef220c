"""TCP ports for the torchrun jobs (``--master-port``) and other listeners that tests start in subprocesses.

A port found by binding to port 0 and closing the socket is taken from the kernel's ephemeral range, where any
other socket bound to port 0 (gloo opens several per process group) or any outgoing connection can take it before
the subprocess binds it (EADDRINUSE). :func:`free_port` hands out ports from a range below the ephemeral range
instead, which the kernel never assigns by itself, split into one disjoint slice per pytest-xdist worker
(``PYTEST_XDIST_WORKER`` = ``gw0``, ``gw1``, ...; the main process has a slice of its own), so two workers of one
run never hand out the same port. Within its slice a process cycles from an offset drawn from its pid (two
separate pytest runs on one machine start apart) and skips any port that cannot be bound right now.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator

__all__ = ["free_port", "port_slice"]

RANGE_LOW, RANGE_HIGH = 20000, 32000  # preferred range: [low, high), below Linux's default ephemeral 32768
MIN_SLICE = 64
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low() -> int:
    """The lowest port the kernel assigns to a bind to port 0 (32768 where /proc does not say)."""
    try:
        with open(_EPHEMERAL_RANGE_FILE) as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _usable_range() -> tuple[int, int]:
    """``[low, high)``: the preferred range cut below the ephemeral range."""
    high = min(RANGE_HIGH, _ephemeral_low())
    low = max(1024, min(RANGE_LOW, high - 4000))
    if high - low < 2 * MIN_SLICE:
        raise RuntimeError(f"the ephemeral port range starts at {high}: too low to leave test ports below it")
    return low, high


def _worker_index(worker: str | None) -> int:
    """0 for the main process (no xdist worker), ``n + 1`` for worker ``gw<n>``."""
    if not worker:
        return 0
    digits = worker.removeprefix("gw")
    if not digits.isdigit():
        raise ValueError(f"unexpected pytest-xdist worker id {worker!r}")
    return int(digits) + 1


def port_slice(worker: str | None = None, workers: int | None = None) -> range:
    """The ports of one process's slice: ``worker`` is an xdist worker id (``gw0``; ``None`` for the main
    process) and ``workers`` the number of workers (by default from ``PYTEST_XDIST_WORKER_COUNT``, else 1)."""
    if workers is None:
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or "1")
    low, high = _usable_range()
    slices = max(workers, 1) + 1
    width = (high - low) // slices
    if width < MIN_SLICE:
        raise ValueError(f"{workers} workers leave slices of {width} ports in [{low}, {high}): too narrow")
    index = _worker_index(worker)
    if index >= slices:  # an id past the count (a replacement worker): share a slice
        index = (index - 1) % (slices - 1) + 1
    start = low + index * width
    return range(start, start + width)


def _bindable(port: int) -> bool:
    """Whether ``port`` can be bound right now on 127.0.0.1 (tests bind nothing beyond the loopback interface; a
    socket bound to every interface on ``port`` makes this bind fail too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_cycles: dict[tuple[int, int], Iterator[int]] = {}


def _cycle(ports: range) -> Iterator[int]:
    """This process's endless walk over ``ports``, starting at an offset drawn from its pid."""
    key = (ports.start, ports.stop)
    if key not in _cycles:
        offset = (os.getpid() * 7919) % len(ports)
        _cycles[key] = itertools.cycle([*ports[offset:], *ports[:offset]])
    return _cycles[key]


def free_port() -> int:
    """A port of this process's slice that binds now; the next call returns a different one."""
    ports = port_slice(os.environ.get("PYTEST_XDIST_WORKER"))
    walk = _cycle(ports)
    for _ in range(len(ports)):
        port = next(walk)
        if _bindable(port):
            return port
    raise RuntimeError(f"no bindable port in {ports}")
