"""Readers of a ``.bin`` on object storage: ranged requests behind a one-chunk cache.

Megatron-Core's ``_S3BinReader`` / ``_MultiStorageClientBinReader`` and
``OBJECT_STORAGE_BIN_READERS`` (re-exported by ``datasets.indexed_dataset``). A read that the
cached chunk does not cover fetches ``[c, max(c + bin_chunk_nbytes, end))`` where ``c`` is the
read's offset rounded down to a multiple of ``bin_chunk_nbytes``; consecutive samples therefore
cost one request per chunk. Unlike Megatron, the MSC reader caches chunks too, reads are bounds
checked, and a response shorter than the requested range raises ``ValueError`` naming the object
and the byte range. The S3 client is re-created in a forked process (data-loader workers).
"""

from __future__ import annotations

import os
from typing import Any

import numpy

from megatron_core.datasets.object_storage_utils import (
    ObjectStorageConfig,
    import_msc,
    is_s3_error_not_found,
    new_s3_client,
    object_size,
    parse_s3_path,
)


class _ChunkCachedBinReader:
    """Ranged reads of one remote object through a cache holding the last fetched chunk."""

    def __init__(self, bin_path: str, object_storage_config: ObjectStorageConfig) -> None:
        if object_storage_config.bin_chunk_nbytes <= 0:
            raise ValueError(f"bin_chunk_nbytes ({object_storage_config.bin_chunk_nbytes}) must be > 0")
        self._bin_path = bin_path
        self._chunk_nbytes = object_storage_config.bin_chunk_nbytes
        self._cache: bytes = b""
        self._cache_start = 0
        self._nbytes: int | None = None

    def _fetch(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object (fewer when it ends sooner)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Size of the remote object in bytes (one metadata request, then remembered)."""
        if self._nbytes is None:
            self._nbytes = object_size(self._bin_path)
        return self._nbytes

    def read(self, dtype: Any, count: int, offset: int) -> numpy.ndarray:
        """``count`` items of ``dtype`` starting at byte ``offset`` (a read-only array)."""
        if count < 0 or offset < 0:
            raise ValueError(f"{self._bin_path}: invalid read of {count} items at byte {offset} (both must be >= 0)")
        size = count * numpy.dtype(dtype).itemsize
        if size == 0:
            return numpy.empty(0, dtype=dtype)
        end = offset + size
        cache_end = self._cache_start + len(self._cache)
        if not (self._cache_start <= offset and end <= cache_end):
            start = (offset // self._chunk_nbytes) * self._chunk_nbytes
            fetch_end = max(start + self._chunk_nbytes, end)
            data = self._fetch(start, fetch_end)
            if start + len(data) < end:
                raise ValueError(
                    f"{self._bin_path}: short read: bytes [{offset}, {end}) were requested, but the object "
                    f"returned only [{start}, {start + len(data)}) of the range [{start}, {fetch_end})"
                )
            self._cache, self._cache_start = data, start
        begin = offset - self._cache_start
        return numpy.frombuffer(self._cache, dtype=dtype, count=count, offset=begin)

    def close(self) -> None:
        """Drop the cached chunk."""
        self._cache = b""


class _S3BinReader(_ChunkCachedBinReader):
    """Reads an ``s3://bucket/key.bin`` with boto3 ``get_object`` range requests."""

    def __init__(self, bin_path: str, object_storage_config: ObjectStorageConfig) -> None:
        super().__init__(bin_path, object_storage_config)
        self._bucket, self._key = parse_s3_path(bin_path)
        self._client: Any = None
        self._client_pid = -1

    def _s3(self) -> Any:
        if self._client is None or self._client_pid != os.getpid():
            self._client, self._client_pid = new_s3_client(), os.getpid()
        return self._client

    def _fetch(self, start: int, end: int) -> bytes:
        try:
            response = self._s3().get_object(Bucket=self._bucket, Key=self._key, Range=f"bytes={start}-{end - 1}")
        except Exception as error:
            if is_s3_error_not_found(error):
                raise FileNotFoundError(f"object not found: {self._bin_path}") from error
            if getattr(error, "response", {}).get("Error", {}).get("Code") == "InvalidRange":
                return b""
            raise
        return response["Body"].read()

    def close(self) -> None:
        """Drop the cache and close the client (only the one this process created)."""
        super().close()
        if self._client is not None and self._client_pid == os.getpid():
            self._client.close()
        self._client = None


class _MultiStorageClientBinReader(_ChunkCachedBinReader):
    """Reads an ``msc://profile/path.bin`` with Multi-Storage Client range reads."""

    def __init__(self, bin_path: str, object_storage_config: ObjectStorageConfig) -> None:
        super().__init__(bin_path, object_storage_config)
        self._msc = import_msc()
        self._client, self._path = self._msc.resolve_storage_client(bin_path)

    def _fetch(self, start: int, end: int) -> bytes:
        try:
            return bytes(self._client.read(path=self._path, byte_range=self._msc.types.Range(offset=start, size=end - start)))
        except FileNotFoundError as error:
            raise FileNotFoundError(f"object not found: {self._bin_path}") from error


OBJECT_STORAGE_BIN_READERS: dict[str, type[_ChunkCachedBinReader]] = {
    "s3": _S3BinReader,
    "msc": _MultiStorageClientBinReader,
}
"""``get_object_storage_access(path)`` -> the ``.bin`` reader class for that storage."""

__all__ = ["OBJECT_STORAGE_BIN_READERS"]
