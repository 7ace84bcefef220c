"""Megatron-LM's checkpoint directory layout: ``<save>/iter_0000010/`` plus the ``latest`` tracker.

The tracker ``latest_checkpointed_iteration.txt`` holds the iteration of the newest complete
checkpoint. It is replaced atomically (temp file, fsync, rename, directory fsync) only after that
checkpoint was renamed into place, so a crash at any point leaves the previous value, which
names a complete checkpoint. Unlike Megatron-LM, an unreadable tracker raises instead of exiting.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_core.dist_checkpointing.core import CheckpointingException, atomic_write_text

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


def get_checkpoint_tracker_filename(save_dir: str | os.PathLike) -> Path:
    """Path of the tracker file in ``save_dir``."""
    return Path(save_dir) / TRACKER_FILENAME


def get_checkpoint_name(save_dir: str | os.PathLike, iteration: int) -> Path:
    """``<save_dir>/iter_<iteration, 7 digits>``."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return Path(save_dir) / f"iter_{iteration:07d}"


def read_tracker(save_dir: str | os.PathLike) -> int | None:
    """The iteration named by the tracker, ``None`` when there is no tracker.

    Raises ``CheckpointingException`` naming the file when it is empty, truncated or not an integer.
    """
    path = get_checkpoint_tracker_filename(save_dir)
    if not path.exists():
        return None
    text = path.read_text(encoding="utf-8", errors="replace").strip()
    if not text.isdigit():
        raise CheckpointingException(f"{path} must hold a non-negative iteration number, found {text[:40]!r}")
    return int(text)


def write_tracker(save_dir: str | os.PathLike, iteration: int) -> None:
    """Atomically point the tracker at ``iteration`` (call on one rank)."""
    atomic_write_text(get_checkpoint_tracker_filename(save_dir), f"{int(iteration)}\n")
