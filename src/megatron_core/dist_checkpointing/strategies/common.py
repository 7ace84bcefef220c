"""The common (non-sharded) state as a separate ``common.pt`` file (Megatron-Core's ``strategies.common``).

megatron-core <= 0.18 keeps the common state in ``<checkpoint>/common.pt``; 0.19 stores it inside the DCP
files and keeps :func:`save_common` / :func:`load_common` as deprecated helpers for that older file. Here
they write and read the same file as :mod:`megatron_core.dist_checkpointing.common_state` does for
``save(..., common_strategy="torch")``: the state must be plain data, and it is read with
``torch.load(weights_only=True)``, so loading never runs code from the checkpoint.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch.distributed as dist

from megatron_core.dist_checkpointing.common_state import COMMON_STATE_FNAME, serialize_common
from megatron_core.dist_checkpointing.core import CheckpointingException, atomic_write_bytes
from megatron_core.dist_checkpointing.mapping import StateDict
from megatron_core.dist_checkpointing.safe_load import torch_load_safe

__all__ = ["COMMON_STATE_FNAME", "load_common", "save_common"]

logger = logging.getLogger(__name__)


def save_common(common_state_dict: StateDict, checkpoint_dir: str | os.PathLike) -> None:
    """Write ``common_state_dict`` to ``<checkpoint_dir>/common.pt`` (rank 0 only; every rank when
    ``torch.distributed`` is not initialized). ``CheckpointingException`` when it is not plain data."""
    logger.warning("save_common is deprecated (Megatron-Core 0.19): `save` stores the common state in the "
                   "checkpoint's DCP files; use save(..., common_strategy='torch') for the older common.pt layout")
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    atomic_write_bytes(Path(checkpoint_dir) / COMMON_STATE_FNAME, serialize_common(common_state_dict))


def load_common(checkpoint_dir: str | os.PathLike) -> StateDict:
    """The common state of ``<checkpoint_dir>/common.pt``, read with ``weights_only=True`` on the CPU;
    ``CheckpointingException`` when the file is missing or holds anything but plain data."""
    logger.warning("load_common is deprecated (Megatron-Core 0.19): use load_common_state_dict, which also reads "
                   "the common state of 0.19 checkpoints")
    path = Path(checkpoint_dir) / COMMON_STATE_FNAME
    if not path.is_file():
        present = sorted(p.name for p in Path(checkpoint_dir).iterdir()) if Path(checkpoint_dir).is_dir() else []
        logger.debug("Common file %s does not exist; the checkpoint directory holds %s", path, present)
        raise CheckpointingException(f"Common file {path} does not exist")
    return torch_load_safe(path, str(path))
