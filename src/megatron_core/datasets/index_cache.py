"""Cached index files: ``<hash>-<Class>-<split>-<name>.npy`` plus ``description.txt``, as Megatron names them.

Writes are crash-safe: each file goes to a temporary name and is renamed into place, and the
description is written last, so a cache that an interrupted build left behind is never taken
for complete (Megatron writes in place). Loads memory-map the arrays without pickle.

A cache is tied to the data files it was built from: ``<hash>-<Class>-<split>-source.json``
records the ``.bin``/``.idx`` sizes, modification times and the ``.idx``'s SHA-256. When the data
at the prefix was regenerated, the cache is rebuilt and a warning says why (Megatron would reuse
it and serve samples that no longer match the data). A cached array that fails to load raises
naming its path.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile

import numpy


@functools.lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
    return sha.hexdigest()


def data_identity(path_prefix: str) -> dict:
    """Sizes and modification times of ``<prefix>.bin`` / ``.idx`` and the ``.idx``'s SHA-256."""
    out: dict = {}
    for suffix in ("bin", "idx"):
        stat = os.stat(f"{path_prefix}.{suffix}")
        out[f"{suffix}_size"], out[f"{suffix}_mtime_ns"] = stat.st_size, stat.st_mtime_ns
    out["idx_sha256"] = _sha256(f"{path_prefix}.idx", out["idx_size"], out["idx_mtime_ns"])
    return out


class IndexCache:
    """The cache files of one dataset: ``names`` are the array files, plus ``description.txt``."""

    def __init__(self, directory: str, base: str, names: tuple[str, ...], source: dict | None = None) -> None:
        self.directory = directory
        self.paths = {name: os.path.join(directory, f"{base}-{name}.npy") for name in names}
        self.description_path = os.path.join(directory, f"{base}-description.txt")
        self.source = source
        self.source_path = os.path.join(directory, f"{base}-source.json")

    def stale_reason(self) -> str | None:
        """Why the cache does not belong to the current data files (``None`` when it does)."""
        if self.source is None:
            return None
        try:
            with open(self.source_path, encoding="utf-8") as f:
                recorded = json.load(f)
        except FileNotFoundError:
            return f"{self.source_path} is missing (the cache does not say which data it was built from)"
        except (OSError, ValueError) as e:
            return f"{self.source_path} is unreadable ({e})"
        changed = [f"{k} {recorded.get(k)!r} -> {v!r}" for k, v in self.source.items() if recorded.get(k) != v]
        return f"the data files changed since the cache was built ({'; '.join(changed)})" if changed else None

    def complete(self) -> bool:
        """True when the description and every array file exist."""
        return all(os.path.isfile(path) for path in [self.description_path, *self.paths.values()])

    def _replace(self, path: str, write) -> None:
        handle, temporary = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=os.path.basename(path))
        try:
            with os.fdopen(handle, "wb") as stream:
                write(stream)
            os.replace(temporary, path)
        except BaseException:
            if os.path.exists(temporary):
                os.remove(temporary)
            raise

    def save(self, description: str, arrays: dict[str, numpy.ndarray]) -> None:
        """Write every array, then the description."""
        os.makedirs(self.directory, exist_ok=True)
        for name, array in arrays.items():
            self._replace(self.paths[name], lambda stream, array=array: numpy.save(stream, array, allow_pickle=False))
        if self.source is not None:
            body = json.dumps(self.source, indent=1, sort_keys=True).encode("utf-8")
            self._replace(self.source_path, lambda stream: stream.write(body))
        self._replace(self.description_path, lambda stream: stream.write(description.encode("utf-8")))

    def load(self) -> dict[str, numpy.ndarray]:
        """Memory-map every array read-only; a file that fails to load raises naming its path."""
        out = {}
        for name, path in self.paths.items():
            try:
                out[name] = numpy.load(path, allow_pickle=False, mmap_mode="r")
            except Exception as e:  # noqa: BLE001 - any failure: name the file and the way out
                raise ValueError(f"cached index file {path} cannot be loaded ({type(e).__name__}: {e}); delete it "
                                 "(or the whole cache directory) to rebuild it") from e
        return out
