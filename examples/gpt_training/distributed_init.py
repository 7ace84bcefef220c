"""Start torch.distributed for a training script: under torchrun (env://) or as a single process."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_core import device


def init_distributed(timeout_minutes: int = 10) -> tuple[int, int]:
    """Initialise the default process group (NCCL on GPUs, gloo on CPU); return (rank, world_size).

    Without torchrun's environment a one-rank group is created on an in-memory store (no
    rendezvous port) with gloo bound to the loopback interface, so the script also runs as plain
    ``python`` and listens on 127.0.0.1 only.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = device.get_default_backend()
    single = "RANK" not in os.environ
    if single:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        loopback = _loopback_interface()
        if backend == "gloo" and loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = loopback  # gloo's own listening socket stays on 127.0.0.1
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(minutes=timeout_minutes)
    if single:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def _loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux), if one is found."""
    import socket

    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name.startswith("lo")), None)
