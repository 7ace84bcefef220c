"""``s3://`` indexed datasets against moto's in-process S3 mock: every read equals the local files'.

moto's ``mock_aws`` patches botocore inside this process (no network, no server); the corpora are
the local ``corpora`` fixture's files uploaded to a mocked bucket.
"""

from __future__ import annotations

import os
import pickle

import numpy
import pytest

pytest.importorskip("boto3", reason="boto3 (extra 's3') is not installed")
moto = pytest.importorskip("moto", reason="moto (dev extra) is not installed")

from megatron_core.datasets import object_storage_utils as osu  # noqa: E402
from megatron_core.datasets.indexed_dataset import OBJECT_STORAGE_BIN_READERS, IndexedDataset, _S3BinReader  # noqa: E402
from megatron_core.datasets.object_storage_utils import ObjectStorageConfig, dataset_exists  # noqa: E402
from tests.datasets.object_storage_helpers import (  # noqa: E402
    assert_same_indexed,
    assert_same_splits,
    build_splits,
    gpt_config,
)

BUCKET = "corpora"


@pytest.fixture
def s3_corpora(corpora, monkeypatch):
    """``{name: s3://corpora/data/<name>}`` for the local corpora a and b, inside ``mock_aws``."""
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    with moto.mock_aws():
        client = osu.new_s3_client()
        client.create_bucket(Bucket=BUCKET)
        for name in ("a", "b"):
            for suffix in (".bin", ".idx"):
                client.upload_file(Filename=corpora[name] + suffix, Bucket=BUCKET, Key=f"data/{name}{suffix}")
        client.close()
        yield {name: f"s3://{BUCKET}/data/{name}" for name in ("a", "b")}


@pytest.fixture
def downloads(monkeypatch):
    """Remote paths passed to the ``.idx`` download, in order."""
    seen: list[str] = []
    real = osu._download

    def counting(remote_path: str, local_path: str) -> None:
        seen.append(remote_path)
        real(remote_path, local_path)

    monkeypatch.setattr(osu, "_download", counting)
    return seen


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_indexed_dataset_matches_local(s3_corpora, corpora, tmp_path, chunk):
    config = ObjectStorageConfig(path_to_idx_cache=str(tmp_path / "idx"), bin_chunk_nbytes=chunk)
    remote = IndexedDataset(s3_corpora["a"], mmap=False, object_storage_config=config)
    assert isinstance(remote.bin_reader, _S3BinReader) and OBJECT_STORAGE_BIN_READERS["s3"] is _S3BinReader
    assert assert_same_indexed(remote, IndexedDataset(corpora["a"])) == 200
    assert assert_same_indexed(pickle.loads(pickle.dumps(remote)), IndexedDataset(corpora["a"])) == 200


def test_index_is_cached_once_and_reused(s3_corpora, corpora, tmp_path, downloads):
    cache = tmp_path / "idx"
    config = ObjectStorageConfig(path_to_idx_cache=str(cache))
    IndexedDataset(s3_corpora["a"], mmap=False, object_storage_config=config)
    cached = cache / BUCKET / "data" / "a.idx"
    assert cached.read_bytes() == open(corpora["a"] + ".idx", "rb").read()
    inode = os.stat(cached).st_ino
    IndexedDataset(s3_corpora["a"], mmap=False, object_storage_config=config)
    assert downloads == [f"{s3_corpora['a']}.idx"]
    assert os.stat(cached).st_ino == inode
    cached.write_bytes(b"stale")  # a different size: downloaded again, atomically replaced
    again = IndexedDataset(s3_corpora["a"], mmap=False, object_storage_config=config)
    assert len(downloads) == 2 and len(again) == 200
    assert sorted(os.listdir(cached.parent)) == ["a.idx"]  # no temporary file left behind


def test_builder_matches_local(s3_corpora, corpora, tmp_path):
    sizes = [300, 40, 20]
    local = build_splits(gpt_config([corpora["a"], corpora["b"]], path_to_cache=str(tmp_path / "local")), sizes)
    remote_config = gpt_config([s3_corpora["a"], s3_corpora["b"]], mmap_bin_files=False,
                               object_storage_cache_path=str(tmp_path / "idx"))
    remote = build_splits(remote_config, sizes)
    assert assert_same_splits(remote, local) > 300
    single = gpt_config([s3_corpora["b"]], mmap_bin_files=False, object_storage_cache_path=str(tmp_path / "idx"))
    assert assert_same_splits(build_splits(single, sizes), build_splits(gpt_config([corpora["b"]]), sizes)) > 300


def test_exists(s3_corpora):
    assert IndexedDataset.exists(s3_corpora["a"])
    assert dataset_exists(s3_corpora["a"], s3_corpora["a"] + ".idx", s3_corpora["a"] + ".bin")
    assert not IndexedDataset.exists(f"s3://{BUCKET}/data/missing")
    assert not IndexedDataset.exists("s3://no-such-bucket/data/a")


def test_missing_objects_are_named(s3_corpora, tmp_path):
    config = ObjectStorageConfig(path_to_idx_cache=str(tmp_path / "idx"))
    with pytest.raises(FileNotFoundError, match=f"object not found: s3://{BUCKET}/data/missing.idx"):
        IndexedDataset(f"s3://{BUCKET}/data/missing", mmap=False, object_storage_config=config)
    client = osu.new_s3_client()
    client.copy_object(Bucket=BUCKET, Key="data/lonely.idx", CopySource={"Bucket": BUCKET, "Key": "data/a.idx"})
    client.close()
    with pytest.raises(FileNotFoundError, match=f"object not found: s3://{BUCKET}/data/lonely.bin"):
        IndexedDataset(f"s3://{BUCKET}/data/lonely", mmap=False, object_storage_config=config)


def test_short_and_invalid_reads_are_named(s3_corpora, corpora, tmp_path):
    size = os.path.getsize(corpora["a"] + ".bin")
    reader = _S3BinReader(s3_corpora["a"] + ".bin", ObjectStorageConfig(str(tmp_path), bin_chunk_nbytes=64))
    assert reader.nbytes == size
    tail = reader.read(numpy.uint16, 2, size - 4)
    assert numpy.array_equal(tail, numpy.fromfile(corpora["a"] + ".bin", dtype=numpy.uint16)[-2:])
    with pytest.raises(ValueError, match=rf"{s3_corpora['a']}.bin: short read: bytes \[{size - 2}, {size + 2}\)"):
        reader.read(numpy.uint16, 2, size - 2)
    with pytest.raises(ValueError, match=rf"short read: bytes \[{size + 100}, {size + 104}\)"):
        reader.read(numpy.uint16, 2, size + 100)
    with pytest.raises(ValueError, match="must be >= 0"):
        reader.read(numpy.uint16, 2, -2)
    reader.close()
