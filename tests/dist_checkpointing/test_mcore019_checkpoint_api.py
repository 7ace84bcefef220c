"""Megatron-Core 0.19 dist_checkpointing additions: ShardedTensor.narrow, the integrity manifest,
determine_global_metadata, CachedMetadataFileSystemReader, strategies.nvrx / filesystem_async /
checkpointable, get_async_strategy. Single process (DCP without a process group)."""

from __future__ import annotations

import json
import pickle
import sys
from types import ModuleType
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_core.dist_checkpointing import CheckpointingException, ShardedTensor, load, save
from megatron_core.dist_checkpointing.strategies import nvrx
from megatron_core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from megatron_core.dist_checkpointing.strategies.checkpointable import (
    CheckpointableShardedTensor,
    LocalShardsContainer,
)
from megatron_core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron_core.dist_checkpointing.strategies.torch import get_async_strategy
from megatron_core.dist_checkpointing.validation import (
    determine_global_metadata,
    save_integrity_manifest,
    verify_integrity_manifest,
)


def test_narrow_scales_global_shape_and_offset():
    data = torch.arange(3 * 4.0).reshape(3, 4)
    sh = ShardedTensor.from_rank_offsets("k", data, (0, 2, 5))  # rows [6, 9) of 15
    (nar,) = sh.narrow(0, 1, 2)
    assert (nar.local_shape, nar.global_shape, nar.global_offset) == ((2, 4), (10, 4), (4, 0))
    assert torch.equal(nar.data, data[1:3])
    irregular = ShardedTensor("k", data, data.dtype, (3, 4), (8, 4), (5, 0), None)
    with pytest.raises(CheckpointingException, match="regular grid"):
        irregular.narrow(0, 0, 1)


def test_integrity_manifest_roundtrip_and_tamper(tmp_path):
    ckpt = tmp_path / "c"
    save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(4))}, ckpt, verify_integrity=True)
    manifest = json.loads((ckpt / "integrity.json").read_text())
    assert manifest["algorithm"] == "sha256" and "__0_0.distcp" in manifest["files"]
    assert all(len(h) == 64 for h in manifest["files"].values())
    assert ".mcore_save_in_progress" not in manifest["files"]
    out = load({"a": ShardedTensor.from_rank_offsets("a", torch.zeros(4))}, ckpt, verify_integrity=True)
    assert torch.equal(out["a"], torch.ones(4))
    with open(ckpt / "__0_0.distcp", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(CheckpointingException, match="hash mismatch"):
        load({"a": ShardedTensor.from_rank_offsets("a", torch.zeros(4))}, ckpt, verify_integrity=True)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "x.bin").write_bytes(b"abc")
    save_integrity_manifest(plain)
    verify_integrity_manifest(plain)
    (plain / "x.bin").write_bytes(b"abd")
    with pytest.raises(CheckpointingException, match="x.bin: hash mismatch"):
        verify_integrity_manifest(plain)


def test_determine_global_metadata_single_process():
    sh = ShardedTensor.from_rank_offsets("a", torch.ones(2))
    local, global_ = determine_global_metadata({"x": sh})
    assert local[0].data is None and local[0].key == "a" and global_ == [local]


def test_cached_reader_reads_metadata_once_and_refuses_hostile_pickles(tmp_path):
    ckpt = tmp_path / "c"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=ckpt, no_dist=True)
    CachedMetadataFileSystemReader.clear_metadata_cache()
    first = CachedMetadataFileSystemReader(ckpt).read_metadata()
    assert CachedMetadataFileSystemReader(ckpt).read_metadata() is first
    assert CachedMetadataFileSystemReader(ckpt, cache_metadata=False).read_metadata() is not first
    (ckpt / ".metadata").write_bytes(pickle.dumps(sys.modules["os"].system))
    CachedMetadataFileSystemReader.clear_metadata_cache()
    with pytest.raises(CheckpointingException, match="not allowed"):
        CachedMetadataFileSystemReader(ckpt).read_metadata()


def test_nvrx_helpers_without_and_with_a_fake_package():
    assert nvrx.has_nvrx_async_support() is False
    assert nvrx.is_nvrx_min_version() is False
    fake = {f"nvidia_resiliency_ext.checkpointing.async_ckpt.{n}": mock.MagicMock()
            for n in ("core", "cached_metadata_filesystem_reader", "filesystem_async", "state_dict_saver")}
    with mock.patch.object(nvrx, "import_module", side_effect=lambda name: fake[name]):
        with mock.patch.object(nvrx, "is_nvrx_min_version", return_value=True):
            assert nvrx.has_nvrx_async_support() is True
        with mock.patch.object(nvrx, "is_nvrx_min_version", return_value=False):
            with pytest.raises(AssertionError, match="Minimum required nvidia-resiliency-ext"):
                nvrx.has_nvrx_async_support()
    old = ModuleType("nvidia_resiliency_ext")
    old.__version__ = "0.5.0"
    with mock.patch.dict(sys.modules, {"nvidia_resiliency_ext": old}):
        assert nvrx.is_nvrx_min_version() is False and nvrx.is_nvrx_min_version("0.4") is True


def test_get_async_strategy_and_save_async_strategy(tmp_path):
    name, modules = get_async_strategy("mcore")
    assert name == "mcore" and modules["FileSystemWriterAsync"] is FileSystemWriterAsync
    with pytest.raises(ModuleNotFoundError, match="nvidia-resiliency-ext"):
        get_async_strategy("nvrx")
    with pytest.raises(TypeError, match="not supported"):
        get_async_strategy("other")
    with pytest.raises(ModuleNotFoundError):
        save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2))}, tmp_path / "n", async_strategy="nvrx")


def test_filesystem_writer_async_writes_dcp_files(tmp_path):
    weights = {"w": torch.arange(6.0), "v": torch.ones(2, 2)}
    writer = FileSystemWriterAsync(tmp_path / "c")
    dcp.save(weights, storage_writer=writer, no_dist=True)
    out = {"w": torch.zeros(6), "v": torch.zeros(2, 2)}
    dcp.load(out, checkpoint_id=tmp_path / "c", no_dist=True)
    assert all(torch.equal(out[k], weights[k]) for k in weights)
    with pytest.raises(NotImplementedError):
        FileSystemWriterAsync(tmp_path / "d", single_file_per_rank=False)


def test_checkpointable_sharded_tensors_roundtrip_through_dcp(tmp_path):
    def state(value: float) -> dict:
        parts = [ShardedTensor.from_rank_offsets("t", torch.full((3,), value + i), (0, i, 2)) for i in range(2)]
        return {"t": LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(p) for p in parts])}

    dcp.save(state(1.0), checkpoint_id=tmp_path / "c", no_dist=True)
    loaded = state(10.0)
    dcp.load(loaded, checkpoint_id=tmp_path / "c", no_dist=True)
    assert [s._sh_ten.data.tolist() for s in loaded["t"]._local_shards] == [[1.0] * 3, [2.0] * 3]
    with pytest.raises(NotImplementedError):
        loaded["t"] + 1


def test_default_load_strategy_without_a_directory(tmp_path):
    from megatron_core.dist_checkpointing.strategies import get_default_load_sharded_strategy
    from megatron_core.dist_checkpointing.strategies.torch_dist import TorchDistLoadShardedStrategy

    assert isinstance(get_default_load_sharded_strategy(), TorchDistLoadShardedStrategy)
    with pytest.raises(CheckpointingException, match="not a distributed checkpoint"):
        get_default_load_sharded_strategy(tmp_path)


def test_load_returns_content_metadata_and_names_a_non_checkpoint(tmp_path):
    from megatron_core.dist_checkpointing import load_common_state_dict, load_content_metadata

    meta = {"nested": {"a": 3}, "flat": [5]}
    save({"common": (3, 5, 7)}, tmp_path / "c", content_metadata=meta)
    loaded = load({"common": (3, 5, 7)}, tmp_path / "c")
    assert loaded["content_metadata"] == meta and load_content_metadata(preloaded_state_dict=loaded) == meta
    assert load_common_state_dict(tmp_path / "c")["content_metadata"] == meta
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointingException, match="is not a distributed checkpoint"):
        load({"common": 1}, tmp_path / "empty")
