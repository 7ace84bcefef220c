"""``CachedMetadataFileSystemReader``: a DCP file-system reader whose metadata is read once per directory.

The metadata is read with :func:`~megatron_core.dist_checkpointing.safe_load.read_dcp_metadata` (a
restricted unpickler plus a storage-table check), never with DCP's plain ``pickle.load``.
"""

from __future__ import annotations

import os
from typing import ClassVar

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from megatron_core.dist_checkpointing.safe_load import read_dcp_metadata


class CachedMetadataFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` sharing one metadata object among all readers of the same directory.

    Args:
        path: the checkpoint directory.
        cache_metadata: when False, this reader neither reads from nor fills the shared cache.
    """

    _metadata_cache: ClassVar[dict[str, Metadata]] = {}

    def __init__(self, path: str | os.PathLike, cache_metadata: bool = True) -> None:
        super().__init__(path=path)
        self._checkpoint_dir = os.fspath(path)
        self._cache_key = os.path.abspath(self._checkpoint_dir) if cache_metadata else None

    def read_metadata(self) -> Metadata:
        """The directory's DCP metadata, read safely on first use and cached by absolute path."""
        if self._cache_key is None:
            return read_dcp_metadata(self._checkpoint_dir)
        cache = CachedMetadataFileSystemReader._metadata_cache
        if self._cache_key not in cache:
            cache[self._cache_key] = read_dcp_metadata(self._checkpoint_dir)
        return cache[self._cache_key]

    @classmethod
    def clear_metadata_cache(cls) -> None:
        """Forget every cached metadata object (e.g. after a directory was rewritten)."""
        cls._metadata_cache.clear()


__all__ = ["CachedMetadataFileSystemReader"]
