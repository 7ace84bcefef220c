"""Start torch.distributed for a training script: under torchrun (env://) or as a single process."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_core import device
from megatron_core.inference.cli.local_process_group import init_local_process_group


def init_distributed(timeout_minutes: int = 10) -> tuple[int, int]:
    """Initialise the default process group (NCCL on GPUs, gloo on CPU); return (rank, world_size).

    Without torchrun's environment a one-rank group is created on an in-memory store (no
    rendezvous port) with gloo bound to the loopback interface, so the script also runs as plain
    ``python`` and listens on 127.0.0.1 only.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    timeout = timedelta(minutes=timeout_minutes)
    if init_local_process_group(timeout):  # no torchrun: one rank, nothing listening beyond 127.0.0.1
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        return 0, 1
    backend = device.get_default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()
