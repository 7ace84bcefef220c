"""Rank and world size that work before (or without) ``torch.distributed`` (Megatron-Core's ``_rank_utils``).

Order of sources: the initialised default process group, then torchrun's ``RANK``/``WORLD_SIZE``,
then SLURM's ``SLURM_PROCID``/``SLURM_NTASKS``, then rank 0 of 1 with a warning.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch

from megatron_core._slurm_utils import resolve_slurm_rank, resolve_slurm_world_size


def _distributed_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def safe_get_rank() -> int:
    """This process's global rank, whether or not ``torch.distributed`` is initialised."""
    if _distributed_ready():
        return torch.distributed.get_rank()
    try:
        if "RANK" in os.environ:
            return int(os.environ["RANK"])
        slurm_rank = resolve_slurm_rank()
    except (TypeError, ValueError):
        return 0
    if slurm_rank is not None:
        return slurm_rank
    warnings.warn("safe_get_rank: no process group, RANK or SLURM_PROCID; assuming rank 0", stacklevel=2)
    return 0


def safe_get_world_size() -> int:
    """The job's world size, whether or not ``torch.distributed`` is initialised."""
    if _distributed_ready():
        return torch.distributed.get_world_size()
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    slurm_world = resolve_slurm_world_size()
    if slurm_world is not None:
        return slurm_world
    warnings.warn(
        "safe_get_world_size: no process group, WORLD_SIZE or SLURM_NTASKS; assuming world size 1", stacklevel=2
    )
    return 1


def log_single_rank(logger: logging.Logger, *args: Any, rank: int = 0, **kwargs: Any) -> None:
    """``logger.log(*args, **kwargs)`` on global rank ``rank`` only."""
    if safe_get_rank() == rank:
        logger.log(*args, **kwargs)
