"""Start torch.distributed for a training script: under torchrun (env://) or as a single process."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_core import device


def init_distributed(timeout_minutes: int = 10) -> tuple[int, int]:
    """Initialise the default process group (NCCL on GPUs, gloo on CPU); return (rank, world_size).

    Without torchrun's environment a one-rank group on a free local port is created, so the
    script also runs as plain ``python``.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = device.get_default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
    return dist.get_rank(), dist.get_world_size()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
