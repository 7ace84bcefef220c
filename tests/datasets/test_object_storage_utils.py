"""``datasets.object_storage_utils`` path helpers, config checks and the optional-extra errors (no client needed)."""

from __future__ import annotations

import os
import sys

import pytest

from megatron_core.datasets import object_storage_utils as osu
from megatron_core.datasets.indexed_dataset import IndexedDataset
from megatron_core.datasets.object_storage_utils import (
    MSC_PREFIX,
    S3_PREFIX,
    ObjectStorageConfig,
    S3Config,
    get_index_cache_path,
    get_object_storage_access,
    is_object_storage_path,
    parse_s3_path,
)
from megatron_core.msc_utils import MultiStorageClientFeature


def test_prefixes_and_path_kinds():
    assert (S3_PREFIX, MSC_PREFIX) == ("s3://", "msc://")
    assert is_object_storage_path("s3://bucket/data/a")
    assert is_object_storage_path("msc://profile/data/a")
    assert not is_object_storage_path("/tmp/data/a")
    assert not is_object_storage_path("data/s3://a")
    assert get_object_storage_access("s3://bucket/a") == "s3"
    assert get_object_storage_access("msc://profile/a") == "msc"
    assert S3Config is ObjectStorageConfig


def test_parse_s3_path():
    assert parse_s3_path("s3://bucket/data/train/a.bin") == ("bucket", "data/train/a.bin")
    assert parse_s3_path("s3://bucket/a") == ("bucket", "a")
    assert parse_s3_path("s3://bucket") == ("bucket", "")
    with pytest.raises(ValueError, match="does not start with 's3://'"):
        parse_s3_path("msc://profile/a")
    with pytest.raises(ValueError, match="names no bucket"):
        parse_s3_path("s3:///key")


def test_index_cache_path(tmp_path):
    config = ObjectStorageConfig(path_to_idx_cache=str(tmp_path))
    assert get_index_cache_path("s3://bucket/data/a.idx", config) == os.path.join(str(tmp_path), "bucket/data/a.idx")
    assert get_index_cache_path("msc://prof/data/a.idx", config) == os.path.join(str(tmp_path), "prof/data/a.idx")
    with pytest.raises(ValueError, match="not an s3:// or msc:// path"):
        get_index_cache_path("/local/a.idx", config)
    with pytest.raises(ValueError, match="outside path_to_idx_cache"):
        get_index_cache_path("s3://bucket/../../etc/a.idx", config)


def test_config_errors(tmp_path):
    assert ObjectStorageConfig(str(tmp_path)).bin_chunk_nbytes == 256 * 1024 * 1024
    with pytest.raises(ValueError, match=r"bin_chunk_nbytes \(0\) must be > 0"):
        ObjectStorageConfig(str(tmp_path), bin_chunk_nbytes=0)
    with pytest.raises(ValueError, match="path_to_idx_cache"):
        ObjectStorageConfig("")
    config = ObjectStorageConfig(str(tmp_path))
    with pytest.raises(ValueError, match="object_storage_config .* is required"):
        IndexedDataset("s3://bucket/a", mmap=False)
    with pytest.raises(ValueError, match=r"mmap \(True\) must be False"):
        IndexedDataset("s3://bucket/a", object_storage_config=config)
    with pytest.raises(ValueError, match="only for s3:// or msc:// prefixes"):
        IndexedDataset(str(tmp_path / "a"), mmap=False, object_storage_config=config)


def test_gpt_config_requires_cache_path_for_remote_prefix():
    from megatron_core.datasets import GPTDataset
    from tests.datasets.object_storage_helpers import gpt_config

    config = gpt_config(["s3://bucket/a"], mmap_bin_files=False)
    with pytest.raises(ValueError, match=r"object_storage_cache_path \(None\) must be set"):
        GPTDataset.build_low_level_dataset("s3://bucket/a", config)


def test_missing_boto3_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(ImportError, match=r"megatron-core-lite\[s3\]"):
        osu.new_s3_client()


def test_missing_msc_names_the_extra(monkeypatch):
    monkeypatch.setattr(osu, "_msc_package", lambda: None)
    with pytest.raises(ImportError, match=r"megatron-core-lite\[msc\]"):
        osu.import_msc()


def test_msc_requires_the_feature_flag():
    pytest.importorskip("multistorageclient")
    MultiStorageClientFeature.disable()
    with pytest.raises(RuntimeError, match="MultiStorageClientFeature.enable"):
        osu.import_msc()
