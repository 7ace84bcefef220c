"""``tests/ports.py``: per-worker port slices are disjoint, below the ephemeral range, and hand out bindable ports."""

from __future__ import annotations

import socket

import pytest

from tests import ports


def test_worker_slices_are_disjoint_and_below_the_ephemeral_range() -> None:
    main, gw0, gw1 = (set(ports.port_slice(w, workers=2)) for w in (None, "gw0", "gw1"))
    assert min(len(main), len(gw0), len(gw1)) >= ports.MIN_SLICE
    assert not main & gw0 and not main & gw1 and not gw0 & gw1
    assert max(main | gw0 | gw1) < ports._ephemeral_low()
    assert ports.port_slice("gw0", workers=2) == ports.port_slice("gw0", workers=2)


def test_free_port_is_in_this_workers_slice_bindable_and_not_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    first, second = ports.free_port(), ports.free_port()
    assert first != second
    assert {first, second} <= set(ports.port_slice("gw1", workers=2))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", first))


def test_a_bound_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slice_ = ports.port_slice("gw0", workers=2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # the walk offers the held port first, then the slice: the held one must be skipped
        monkeypatch.setitem(ports._cycles, (slice_.start, slice_.stop), iter([taken, *slice_]))
        port = ports.free_port()
    assert port != taken and port in slice_


def test_bad_worker_id_is_refused() -> None:
    with pytest.raises(ValueError, match="worker id"):
        ports.port_slice("node3", workers=2)
