"""Per-file SHA-256 manifest of a checkpoint: corruption is detected, not loaded into a weight.

At save, every data file is hashed while it is written (:class:`HashingFileSystem` wraps the
streams DCP writes through), the digests of all ranks are gathered and rank 0 writes
``sha256_manifest.json`` (file name -> digest and size) just before ``metadata.json``. At load,
when verification is on, the files are split across the ranks, each rank re-hashes its share and
a mismatch, a missing file or a wrong size fails the load on every rank, naming the file. Entry
names must be plain file names inside the checkpoint (no ``..``, no directories, no absolute paths).

Checkpoints without a manifest (written by megatron-core or before this existed) load with a
warning that they were not verified.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.core import CheckpointingException, atomic_write_text
from megatron_core.dist_checkpointing.save_target import IN_PROGRESS_MARKER, MANIFEST_FNAME

logger = logging.getLogger(__name__)

MANIFEST_VERSION = 1
_NOT_HASHED = {MANIFEST_FNAME, IN_PROGRESS_MARKER, "metadata.json"}
_CHUNK = 1 << 22

Digests = dict[str, tuple[str, int]]


class _HashingWriter(io.RawIOBase):
    """A write-only stream that hashes every byte on its way to ``raw``."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        written = self.raw.write(view)
        written = len(view) if written is None else written
        self.sha.update(view[:written])
        self.size += written
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()


class HashingFileSystem(FileSystem):
    """DCP's local file system that records the SHA-256 and size of every file it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: Digests = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, mode) as raw:
            writer = _HashingWriter(raw)
            yield writer
            self.digests[Path(path).name] = (writer.sha.hexdigest(), writer.size)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        record = self.digests.pop(Path(path).name, None)
        if record is not None:
            self.digests[Path(new_path).name] = record


def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """``(hex digest, size)`` of a file, read in chunks."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return sha.hexdigest(), size


def sha256_bytes(data: bytes) -> tuple[str, int]:
    """``(hex digest, size)`` of an in-memory file."""
    return hashlib.sha256(data).hexdigest(), len(data)


def write_manifest(checkpoint_dir: str | os.PathLike, digests: Digests) -> None:
    """Write the manifest (rank 0): ``digests`` plus a fresh hash of any other file in the directory."""
    root = Path(checkpoint_dir)
    files = {}
    for entry in sorted(root.iterdir()):
        if not entry.is_file() or entry.name in _NOT_HASHED or entry.name.endswith(".tmp"):
            continue
        sha, size = digests.get(entry.name) or sha256_file(entry)
        files[entry.name] = {"sha256": sha, "size": size}
    body = {"version": MANIFEST_VERSION, "algorithm": "sha256", "files": files}
    atomic_write_text(root / MANIFEST_FNAME, json.dumps(body, indent=1, sort_keys=True))


def _check_name(name: Any, path: Path) -> str:
    if not isinstance(name, str) or not name or name in (".", "..") or name != os.path.basename(name) \
            or os.path.isabs(name) or "\\" in name or "\x00" in name:
        raise CheckpointingException(f"{path}: entry {name!r} is not a plain file name inside the checkpoint "
                                     "(paths with '..', directories or absolute paths are rejected)")
    return name


def read_manifest(checkpoint_dir: str | os.PathLike) -> dict[str, tuple[str, int]] | None:
    """The manifest's ``{file name: (sha256, size)}``, ``None`` when the checkpoint has none."""
    path = Path(checkpoint_dir) / MANIFEST_FNAME
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointingException(f"{path} is not valid JSON: {e}") from e
    if not isinstance(body, dict) or body.get("algorithm") != "sha256" or not isinstance(body.get("files"), dict):
        raise CheckpointingException(f"{path} is not a sha256 manifest (keys: {sorted(body)[:5]})"
                                     if isinstance(body, dict) else f"{path} does not hold a JSON object")
    out = {}
    for name, entry in body["files"].items():
        _check_name(name, path)
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) \
                or not isinstance(entry.get("size"), int):
            raise CheckpointingException(f"{path}: entry {name!r} needs a 'sha256' string and a 'size' integer")
        out[name] = (entry["sha256"], entry["size"])
    return out


def verify_files(checkpoint_dir: str | os.PathLike, manifest: dict[str, tuple[str, int]],
                 names: list[str]) -> None:
    """Re-hash ``names`` and compare with ``manifest``; raise naming the first file that differs."""
    root = Path(checkpoint_dir)
    for name in names:
        expected_sha, expected_size = manifest[name]
        path = root / name
        if not path.is_file():
            raise CheckpointingException(f"{path} is listed in {MANIFEST_FNAME} but missing: the checkpoint is "
                                         "incomplete")
        size = path.stat().st_size
        if size != expected_size:
            raise CheckpointingException(f"{path} has {size} bytes, {MANIFEST_FNAME} records {expected_size}: "
                                         "the file is truncated or was replaced")
        sha, _ = sha256_file(path)
        if sha != expected_sha:
            raise CheckpointingException(f"{path} is corrupt: its SHA-256 is {sha}, {MANIFEST_FNAME} records "
                                         f"{expected_sha}")


def _unlisted_data_files(checkpoint_dir: Path, manifest: dict[str, tuple[str, int]]) -> list[str]:
    return sorted(p.name for p in checkpoint_dir.iterdir()
                  if p.is_file() and (p.name.endswith(".distcp") or p.name in (".metadata", "common.pt"))
                  and p.name not in manifest)


def verify_checkpoint(checkpoint_dir: str | os.PathLike, group: Any = None) -> bool:
    """Verify every file of the manifest, the work split across ``group``; collective.

    Returns ``False`` (with a warning) when the checkpoint has no manifest; raises
    ``CheckpointingException`` on every rank when any file differs.
    """
    rank, world = collectives.get_rank(group), collectives.get_world_size(group)
    error: str | None = None
    manifest = None
    try:
        manifest = read_manifest(checkpoint_dir)
        if manifest is not None:
            unlisted = _unlisted_data_files(Path(checkpoint_dir), manifest)
            if unlisted:
                raise CheckpointingException(f"{checkpoint_dir}: data files {unlisted[:5]} are not in "
                                             f"{MANIFEST_FNAME}")
            verify_files(checkpoint_dir, manifest, sorted(manifest)[rank::world])
    except CheckpointingException as e:
        error = str(e)
    errors = [e for e in collectives.all_gather_object(error, group) if e is not None]
    if errors:
        raise CheckpointingException(f"checkpoint verification failed: {errors[0]}"
                                     + (f" (and {len(errors) - 1} more ranks found problems)" if len(errors) > 1
                                        else ""))
    if manifest is None:
        if rank == 0 and Path(checkpoint_dir).is_dir():
            logger.warning("%s has no %s (written by megatron-core or an older version): its files were not "
                           "verified", checkpoint_dir, MANIFEST_FNAME)
        return False
    return True
