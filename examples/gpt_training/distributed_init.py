"""Start torch.distributed for a training script (under torchrun (env://) or as a single process) and seed its
generators."""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_core import device
from megatron_core.inference.cli.local_process_group import init_local_process_group
from megatron_core.tensor_parallel import model_parallel_cuda_manual_seed


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
    if backend == "gloo":
        # gloo connects the ranks pairwise inside init_process_group: a rank that refused its flags at once and
        # destroyed the group could close a connection a slower peer was still opening (its traceback instead of
        # the one-line refusal). NCCL connects lazily.
        dist.barrier()
    return dist.get_rank(), dist.get_world_size()


def set_random_seed(seed: int) -> None:
    """Seed every generator the run draws from, as Megatron-LM's training setup does: Python's, NumPy's, the CPU
    generator (``--use-cpu-initialization``, the default, builds the weights with it, also on a GPU) and, through
    :func:`model_parallel_cuda_manual_seed`, the device generator and the tensor/expert-parallel RNG streams.
    Call after ``initialize_model_parallel`` and before building the model.

    Unlike Megatron-LM, the seed is not offset by the pipeline rank: the CPU-initialised weights are the same for
    every parallel layout (the example's resharding and layout tests rely on it)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
