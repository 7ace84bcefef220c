"""``msc://`` indexed datasets through a Multi-Storage Client ``file`` profile, on one and on two ranks.

The profile ``corpora`` maps ``msc://corpora/<path>`` to a local directory holding copies of the
``corpora`` fixture's files (MSC reads them with its POSIX provider, the same API as for a bucket).
On two ranks, only rank 0 downloads the ``.idx`` to the shared cache directory.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy
import pytest
import torch

pytest.importorskip("multistorageclient", reason="multi-storage-client (extra 'msc') is not installed")

from megatron_core.datasets import object_storage_utils as osu  # noqa: E402
from megatron_core.datasets.indexed_dataset import (  # noqa: E402
    OBJECT_STORAGE_BIN_READERS,
    IndexedDataset,
    _MultiStorageClientBinReader,
)
from megatron_core.datasets.object_storage_utils import ObjectStorageConfig  # noqa: E402
from megatron_core.msc_utils import MultiStorageClientFeature  # noqa: E402
from tests.datasets.object_storage_helpers import (  # noqa: E402
    assert_same_indexed,
    assert_same_splits,
    build_splits,
    gpt_config,
)
from tests.dist_harness import run_on_ranks  # noqa: E402

PROFILE = "corpora"


@pytest.fixture(scope="module")
def msc_root(tmp_path_factory, corpora):
    """The profile's directory (copies of corpora a and b under ``data/``) and its MSC config file."""
    root = tmp_path_factory.mktemp("msc")
    os.makedirs(root / "store" / "data")
    for name in ("a", "b"):
        for suffix in (".bin", ".idx"):
            shutil.copyfile(corpora[name] + suffix, root / "store" / "data" / f"{name}{suffix}")
    config = {"profiles": {PROFILE: {"storage_provider": {"type": "file", "options": {"base_path": str(root / "store")}}}}}
    (root / "msc.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def msc_corpora(msc_root, monkeypatch):
    """``{name: msc://corpora/data/<name>}`` with MSC enabled for the test."""
    monkeypatch.setenv("MSC_CONFIG", str(msc_root / "msc.json"))
    MultiStorageClientFeature.enable()
    yield {name: f"msc://{PROFILE}/data/{name}" for name in ("a", "b")}
    MultiStorageClientFeature.disable()


@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_indexed_dataset_matches_local(msc_corpora, corpora, tmp_path, chunk):
    config = ObjectStorageConfig(path_to_idx_cache=str(tmp_path / "idx"), bin_chunk_nbytes=chunk)
    remote = IndexedDataset(msc_corpora["b"], mmap=False, object_storage_config=config)
    assert isinstance(remote.bin_reader, _MultiStorageClientBinReader)
    assert OBJECT_STORAGE_BIN_READERS["msc"] is _MultiStorageClientBinReader
    assert (tmp_path / "idx" / PROFILE / "data" / "b.idx").is_file()
    assert assert_same_indexed(remote, IndexedDataset(corpora["b"])) == 150


def test_builder_matches_local(msc_corpora, corpora, tmp_path):
    sizes = [250, 30, 10]
    local = build_splits(gpt_config([corpora["a"], corpora["b"]]), sizes)
    remote = build_splits(gpt_config([msc_corpora["a"], msc_corpora["b"]], mmap_bin_files=False,
                                     object_storage_cache_path=str(tmp_path / "idx")), sizes)
    assert assert_same_splits(remote, local) > 250


def test_exists_missing_and_short_reads(msc_corpora, msc_root, tmp_path):
    assert IndexedDataset.exists(msc_corpora["a"])
    assert not IndexedDataset.exists(f"msc://{PROFILE}/data/missing")
    config = ObjectStorageConfig(path_to_idx_cache=str(tmp_path / "idx"), bin_chunk_nbytes=32)
    with pytest.raises(FileNotFoundError, match=f"object not found: msc://{PROFILE}/data/missing.idx"):
        IndexedDataset(f"msc://{PROFILE}/data/missing", mmap=False, object_storage_config=config)
    size = os.path.getsize(msc_root / "store" / "data" / "a.bin")
    reader = _MultiStorageClientBinReader(msc_corpora["a"] + ".bin", config)
    assert reader.nbytes == size
    with pytest.raises(ValueError, match=rf"data/a.bin: short read: bytes \[{size - 2}, {size + 2}\)"):
        reader.read(numpy.uint16, 2, size - 2)


def _read_on_ranks(msc_config: str, prefix: str, cache: str) -> dict:
    """Count this rank's ``.idx`` downloads while the builder opens ``prefix``; return its tokens."""
    os.environ["MSC_CONFIG"] = msc_config
    MultiStorageClientFeature.enable()
    seen: list[str] = []
    real = osu._download
    osu._download = lambda remote, local: (seen.append(remote), real(remote, local))[-1]
    try:
        config = gpt_config([prefix], mmap_bin_files=False, object_storage_cache_path=cache)
        train, _, _ = build_splits(config, [100, 10, 10])
        tokens = torch.stack([torch.as_tensor(train[i]["tokens"]) for i in range(len(train))])
    finally:
        osu._download = real
        MultiStorageClientFeature.disable()
    return {"downloads": seen, "tokens": tokens}


def test_two_ranks_download_the_index_once(msc_root, msc_corpora, corpora, tmp_path):
    cache = tmp_path / "idx"
    results = run_on_ranks(2, _read_on_ranks, str(msc_root / "msc.json"), msc_corpora["a"], str(cache))
    assert results[0]["downloads"] == [msc_corpora["a"] + ".idx"]
    assert results[1]["downloads"] == []
    local, _, _ = build_splits(gpt_config([corpora["a"]]), [100, 10, 10])
    expected = torch.stack([torch.as_tensor(local[i]["tokens"]) for i in range(len(local))])
    assert torch.equal(results[0]["tokens"], expected) and torch.equal(results[1]["tokens"], expected)
    assert sorted(os.listdir(cache / PROFILE / "data")) == ["a.idx"]
