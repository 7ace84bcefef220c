"""A one-rank ``torch.distributed`` group that listens on no network interface.

``init_process_group`` with ``MASTER_ADDR=127.0.0.1`` still starts a ``TCPStore`` server bound to
every interface (unauthenticated: anyone who can reach the port can read and write the store). A
single process needs no rendezvous, so :func:`init_local_process_group` gives the group an
in-memory ``HashStore`` instead, and pins gloo's (and NCCL's) sockets to the loopback interface
(gloo opens a listening socket per group even for one rank).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

__all__ = ["init_local_process_group", "loopback_interface"]


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), if found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def init_local_process_group(timeout: timedelta = timedelta(minutes=10)) -> bool:
    """Start a one-rank group (rank 0, world size 1) on a ``HashStore``; ``False`` if one already exists
    or this process is one of several ranks (``WORLD_SIZE`` > 1, e.g. under torchrun), in which case nothing is
    changed. A one-rank torchrun needs no rendezvous either, so it gets the local group too."""
    import torch
    import torch.distributed as dist

    from megatron_core import device

    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return False
    interface = loopback_interface()
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    backend = device.get_default_backend()
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True
