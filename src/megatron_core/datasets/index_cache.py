"""Cached index files: ``<hash>-<Class>-<split>-<name>.npy`` plus ``description.txt``, as Megatron names them.

Writes are crash-safe: each file goes to a temporary name and is renamed into place, and the
description is written last, so a cache that an interrupted build left behind is never taken
for complete (Megatron writes in place). Loads memory-map the arrays without pickle.
"""

from __future__ import annotations

import os
import tempfile

import numpy


class IndexCache:
    """The cache files of one dataset: ``names`` are the array files, plus ``description.txt``."""

    def __init__(self, directory: str, base: str, names: tuple[str, ...]) -> None:
        self.directory = directory
        self.paths = {name: os.path.join(directory, f"{base}-{name}.npy") for name in names}
        self.description_path = os.path.join(directory, f"{base}-description.txt")

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
        self._replace(self.description_path, lambda stream: stream.write(description.encode("utf-8")))

    def load(self) -> dict[str, numpy.ndarray]:
        """Memory-map every array read-only."""
        return {name: numpy.load(path, allow_pickle=False, mmap_mode="r") for name, path in self.paths.items()}
