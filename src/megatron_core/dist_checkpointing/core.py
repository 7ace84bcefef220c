"""Checkpoint-directory basics: the exception type, ``metadata.json`` and atomic file writes.

Megatron-Core marks a directory as a distributed checkpoint by a ``metadata.json`` holding the
sharded backend and its version (``CheckpointingConfig``). We write that file last, atomically
(temp file, fsync, rename, directory fsync), so its presence means the checkpoint is complete.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

CONFIG_FNAME = "metadata.json"


class CheckpointingException(Exception):
    """Any error raised while saving, validating or loading a distributed checkpoint."""


@dataclass
class CheckpointingConfig:
    """What ``metadata.json`` records: the backend that wrote the sharded tensors and its version."""

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str | None = None
    """``"torch"`` for checkpoints with a ``common.pt`` (megatron-core <= 0.18); 0.19 writes neither field."""
    common_backend_version: int | None = None


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry (a rename or a new file) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` for UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def save_config(config: CheckpointingConfig, checkpoint_dir: str | os.PathLike) -> None:
    """Write ``metadata.json`` into ``checkpoint_dir`` atomically."""
    fields = {k: v for k, v in asdict(config).items() if v is not None}
    atomic_write_text(Path(checkpoint_dir) / CONFIG_FNAME, json.dumps(fields))


def maybe_load_config(checkpoint_dir: str | os.PathLike) -> CheckpointingConfig | None:
    """The ``CheckpointingConfig`` of ``checkpoint_dir``, or ``None`` if it is not a distributed checkpoint.

    Raises ``CheckpointingException`` when ``metadata.json`` exists but is not valid.
    """
    config_path = Path(checkpoint_dir) / CONFIG_FNAME
    if not config_path.is_file():
        return None
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointingException(f"{config_path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("sharded_backend"), str):
        raise CheckpointingException(f"{config_path} has no 'sharded_backend' string: {raw!r}")
    known = {k: raw[k] for k in CheckpointingConfig.__dataclass_fields__ if k in raw}
    return CheckpointingConfig(**known)


def check_is_distributed_checkpoint(
    checkpoint_dir: str | os.PathLike,
    read_config: Callable[[str | os.PathLike], CheckpointingConfig | None] = maybe_load_config,
) -> bool:
    """True when ``checkpoint_dir`` holds a complete distributed checkpoint (a valid ``metadata.json``).

    ``read_config`` (not in Megatron-Core) reads ``metadata.json``; a load strategy's ``checkpoint_config``
    keeps what it read, so that one load reads the file once.
    """
    if not Path(checkpoint_dir).is_dir():
        return False
    try:
        return read_config(checkpoint_dir) is not None
    except CheckpointingException:
        return False
