"""Indexed datasets on object storage: paths, the client imports and the local ``.idx`` cache.

Megatron-Core's ``megatron.core.datasets.object_storage_utils``. A ``<prefix>`` of an
``IndexedDataset`` may be ``s3://bucket/key-prefix`` (boto3, extra ``s3``) or
``msc://profile/path`` (Multi-Storage Client, extra ``msc``; ``MultiStorageClientFeature`` must be
enabled, as in Megatron). The ``.idx`` is copied to ``ObjectStorageConfig.path_to_idx_cache`` (at
``get_index_cache_path``) and memory-mapped from there; the ``.bin`` is read with ranged requests.

Only global rank 0 downloads the ``.idx`` (to a temporary file renamed into place, so a reader
never sees half a file); the other ranks wait until the file exists, which after the dataset
builder's barrier it already does. The cache directory must therefore be visible to every rank
(shared, or all ranks on one node). A cached ``.idx`` whose size equals the remote object's is
reused instead of downloaded again. Credentials come from boto3's / MSC's usual sources and are
never logged.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_core.datasets import distributed
from megatron_core.msc_utils import MultiStorageClientFeature, _msc_package

logger = logging.getLogger(__name__)

S3_PREFIX = "s3://"
MSC_PREFIX = "msc://"

_INDEX_WAIT_TIMEOUT_S = 600.0
_INDEX_WAIT_POLL_S = 0.05


@dataclass
class ObjectStorageConfig:
    """Where the ``.idx`` of an object-storage dataset is cached and how the ``.bin`` is fetched.

    ``bin_chunk_nbytes`` is the size of one ranged request for the ``.bin``: a read outside the
    cached chunk fetches the chunk holding its first byte (extended to cover the whole read). Small
    chunks pay the fixed cost of a request often; large ones stall the reader on a miss. Megatron's
    default, 256 MiB, is kept.
    """

    path_to_idx_cache: str
    """Local directory that receives the index (``.idx``) files."""

    bin_chunk_nbytes: int = 256 * 1024 * 1024
    """Bytes fetched per ranged request of the data (``.bin``) file."""

    def __post_init__(self) -> None:
        if not self.path_to_idx_cache:
            raise ValueError(f"ObjectStorageConfig.path_to_idx_cache ({self.path_to_idx_cache!r}) must be a directory path")
        if self.bin_chunk_nbytes <= 0:
            raise ValueError(f"ObjectStorageConfig.bin_chunk_nbytes ({self.bin_chunk_nbytes}) must be > 0")


S3Config = ObjectStorageConfig
"""Megatron's older name for :class:`ObjectStorageConfig` (deprecated there, kept as an alias)."""


class S3Client(Protocol):
    """The boto3 S3 client methods this package uses (any object with them can stand in)."""

    def download_file(self, Bucket: str, Key: str, Filename: str) -> None:
        """Copy object ``Key`` of ``Bucket`` to the local file ``Filename``."""
        ...

    def upload_file(self, Filename: str, Bucket: str, Key: str) -> None:
        """Copy the local file ``Filename`` to object ``Key`` of ``Bucket``."""
        ...

    def head_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        """Metadata of an object (``ContentLength``, ...)."""
        ...

    def get_object(self, Bucket: str, Key: str, Range: str) -> dict[str, Any]:
        """An object's bytes in an inclusive HTTP ``Range`` (``Body`` is a stream)."""
        ...

    def close(self) -> None:
        """Release the client's connections."""
        ...


def import_boto3() -> Any:
    """The ``boto3`` module; ``ImportError`` naming the ``s3`` extra when it is not installed."""
    try:
        return importlib.import_module("boto3")
    except ModuleNotFoundError as error:
        raise ImportError(
            "s3:// datasets need boto3: pip install 'megatron-core-lite[s3]' (or pip install boto3)"
        ) from error


def new_s3_client() -> S3Client:
    """A fresh boto3 S3 client (own session, so threads and forked workers never share one)."""
    return import_boto3().session.Session().client("s3")


def import_msc() -> Any:
    """The ``multistorageclient`` module for ``msc://`` paths.

    ``ImportError`` naming the ``msc`` extra when it is not installed; ``RuntimeError`` when
    ``MultiStorageClientFeature`` is disabled (Megatron's rule: call ``enable()`` first).
    """
    if _msc_package() is None:
        raise ImportError(
            "msc:// datasets need the Multi-Storage Client: pip install 'megatron-core-lite[msc]' "
            "(or pip install multi-storage-client)"
        )
    return MultiStorageClientFeature.import_package()


def is_s3_error_not_found(error: BaseException) -> bool:
    """True for a botocore ``ClientError`` that means the object or bucket does not exist."""
    response = getattr(error, "response", None)
    if not isinstance(response, dict):
        return False
    code = str(response.get("Error", {}).get("Code", ""))
    return code in {"404", "NoSuchKey", "NoSuchBucket", "NotFound"}


def is_object_storage_path(path: str) -> bool:
    """True for ``s3://`` and ``msc://`` paths."""
    return path.startswith(S3_PREFIX) or path.startswith(MSC_PREFIX)


def get_object_storage_access(path: str) -> str:
    """``"s3"`` for ``s3://`` paths, else ``"msc"`` (the key of ``OBJECT_STORAGE_BIN_READERS``)."""
    return "s3" if path.startswith(S3_PREFIX) else "msc"


def parse_s3_path(path: str) -> tuple[str, str]:
    """``(bucket, key)`` of ``s3://bucket/key`` (key ``""`` for a bare bucket)."""
    if not path.startswith(S3_PREFIX):
        raise ValueError(f"parse_s3_path: {path!r} does not start with {S3_PREFIX!r}")
    bucket, _, key = path[len(S3_PREFIX):].partition("/")
    if not bucket:
        raise ValueError(f"parse_s3_path: {path!r} names no bucket (expected s3://bucket/key)")
    return bucket, key


def get_index_cache_path(idx_path: str, object_storage_config: ObjectStorageConfig) -> str:
    """Local cache path of a remote ``.idx``: the cache directory joined with the path after the scheme.

    ``s3://bucket/a/b.idx`` is cached at ``<path_to_idx_cache>/bucket/a/b.idx`` and
    ``msc://profile/a/b.idx`` at ``<path_to_idx_cache>/profile/a/b.idx``.
    """
    if not is_object_storage_path(idx_path):
        raise ValueError(f"get_index_cache_path: {idx_path!r} is not an s3:// or msc:// path")
    prefix = S3_PREFIX if idx_path.startswith(S3_PREFIX) else MSC_PREFIX
    cache_dir = object_storage_config.path_to_idx_cache
    cache_path = os.path.join(cache_dir, idx_path[len(prefix):])
    inside = os.path.normpath(os.path.abspath(cache_path))
    root = os.path.normpath(os.path.abspath(cache_dir))
    if os.path.commonpath([inside, root]) != root:
        raise ValueError(f"get_index_cache_path: {idx_path!r} would be cached outside path_to_idx_cache {cache_dir!r}")
    return cache_path


def object_size(path: str) -> int:
    """Size in bytes of an object; ``FileNotFoundError`` naming it when it does not exist."""
    if path.startswith(S3_PREFIX):
        bucket, key = parse_s3_path(path)
        client = new_s3_client()
        try:
            return int(client.head_object(Bucket=bucket, Key=key)["ContentLength"])
        except Exception as error:
            if is_s3_error_not_found(error):
                raise FileNotFoundError(f"object not found: {path}") from error
            raise
        finally:
            client.close()
    if path.startswith(MSC_PREFIX):
        msc = import_msc()
        if not msc.is_file(path):
            raise FileNotFoundError(f"object not found: {path}")
        return int(msc.info(path).content_length)
    raise ValueError(f"object_size: {path!r} is not an s3:// or msc:// path")


def _object_exists(path: str) -> bool:
    try:
        object_size(path)
    except FileNotFoundError:
        return False
    return True


def dataset_exists(path_prefix: str, idx_path: str, bin_path: str) -> bool:
    """True when both the ``.idx`` and the ``.bin`` objects of an object-storage dataset exist."""
    if not is_object_storage_path(path_prefix):
        raise ValueError(f"dataset_exists: {path_prefix!r} is not an s3:// or msc:// path")
    return _object_exists(idx_path) and _object_exists(bin_path)


def _download(remote_path: str, local_path: str) -> None:
    """Copy ``remote_path`` to ``local_path`` through a temporary file in the same directory."""
    directory = os.path.dirname(local_path) or "."
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f".{os.path.basename(local_path)}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        if remote_path.startswith(S3_PREFIX):
            bucket, key = parse_s3_path(remote_path)
            client = new_s3_client()
            try:
                client.download_file(Bucket=bucket, Key=key, Filename=temporary)
            except Exception as error:
                if is_s3_error_not_found(error):
                    raise FileNotFoundError(f"object not found: {remote_path}") from error
                raise
            finally:
                client.close()
        else:
            import_msc().download_file(remote_path, temporary)
        os.replace(temporary, local_path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def cache_index_file(remote_path: str, local_path: str, timeout_s: float = _INDEX_WAIT_TIMEOUT_S) -> None:
    """Make ``local_path`` a copy of the remote ``.idx`` at ``remote_path``.

    Global rank 0 (or the only process) downloads it, unless ``local_path`` already holds a file of
    the remote object's size, which is reused. Every other rank waits up to ``timeout_s`` seconds
    for ``local_path`` to appear; the rename that publishes it is atomic.
    """
    if not is_object_storage_path(remote_path):
        raise ValueError(f"cache_index_file: {remote_path!r} is not an s3:// or msc:// path")
    if distributed.get_rank() == 0:
        remote_size = object_size(remote_path)
        if os.path.isfile(local_path) and os.path.getsize(local_path) == remote_size:
            logger.info("Reusing the cached index %s for %s", local_path, remote_path)
            return
        logger.info("Downloading the index %s to %s", remote_path, local_path)
        _download(remote_path, local_path)
        return
    deadline = time.monotonic() + timeout_s
    while not os.path.isfile(local_path):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {distributed.get_rank()} waited {timeout_s} s for rank 0 to cache {remote_path} at "
                f"{local_path}; path_to_idx_cache must be a directory every rank can see"
            )
        time.sleep(_INDEX_WAIT_POLL_S)


__all__ = [
    "MSC_PREFIX",
    "S3_PREFIX",
    "ObjectStorageConfig",
    "S3Client",
    "S3Config",
    "cache_index_file",
    "dataset_exists",
    "get_index_cache_path",
    "get_object_storage_access",
    "import_boto3",
    "import_msc",
    "is_s3_error_not_found",
    "is_object_storage_path",
    "new_s3_client",
    "object_size",
    "parse_s3_path",
]
