"""Corruption is detected: the per-file SHA-256 manifest, and the iteration cross-check.

- ``save`` writes ``sha256_manifest.json`` whose digests match every data file;
- a flipped byte or a truncated file makes ``load_checkpoint`` (verification on by default) raise
  naming the file, before anything is copied into the model;
- manifest entries with ``..`` or an absolute path are rejected;
- on two ranks a corrupt shard written by rank 1 fails the load on both ranks, naming the file;
- ``common.pt``'s iteration must match the ``iter_*`` directory it is found in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_core.dist_checkpointing import CheckpointingException, ShardedTensor, load, save
from megatron_core.dist_checkpointing.manifest import read_manifest, sha256_file
from megatron_core.dist_checkpointing.save_target import MANIFEST_FNAME
from megatron_core.training import get_checkpoint_name, load_checkpoint, save_checkpoint
from tests.dist_checkpointing.crash_saver import TinyModel
from tests.dist_harness import run_on_ranks


def _saved(tmp_path: Path) -> tuple[Path, Path]:
    save_dir = tmp_path / "run"
    save_checkpoint(save_dir, 1, TinyModel(1.5), None, None)
    return save_dir, get_checkpoint_name(save_dir, 1)


def _flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


def _untouched(model: TinyModel) -> bool:
    return all(torch.equal(p, torch.zeros_like(p)) for p in model.parameters())


def test_manifest_lists_every_data_file_with_its_digest(tmp_path: Path) -> None:
    _, ckpt = _saved(tmp_path)
    manifest = read_manifest(ckpt)
    data_files = {p.name for p in ckpt.iterdir() if p.name.endswith(".distcp") or p.name in (".metadata", "common.pt")}
    assert ".metadata" in data_files
    assert set(manifest) == data_files
    for name, (sha, size) in manifest.items():
        assert sha256_file(ckpt / name) == (sha, size), name


@pytest.mark.parametrize("damage", ["flip", "truncate", "flip_common"])
def test_damaged_file_is_detected_and_nothing_is_loaded(tmp_path: Path, damage: str) -> None:
    save_dir, ckpt = _saved(tmp_path)
    # the common state lives in rank 0's data file (megatron-core 0.19's layout), or in common.pt (older layout)
    common = ckpt / "common.pt" if (ckpt / "common.pt").exists() else ckpt / "__0_0.distcp"
    target = common if damage == "flip_common" else next(ckpt.glob("*.distcp"))
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-3])
    else:
        _flip_byte(target)
    model = TinyModel(0.0)
    with pytest.raises(CheckpointingException, match=str(target).replace(".", r"\.")) as info:
        load_checkpoint(save_dir, model, None, None)
    assert ("truncated" if damage == "truncate" else "corrupt") in str(info.value)
    assert _untouched(model)


@pytest.mark.parametrize("bad_name", ["../escape.distcp", "/etc/passwd", "sub/dir.distcp"])
def test_manifest_paths_outside_the_checkpoint_are_rejected(tmp_path: Path, bad_name: str) -> None:
    save_dir, ckpt = _saved(tmp_path)
    body = json.loads((ckpt / MANIFEST_FNAME).read_text())
    body["files"][bad_name] = {"sha256": "0" * 64, "size": 1}
    (ckpt / MANIFEST_FNAME).write_text(json.dumps(body))
    with pytest.raises(CheckpointingException, match="not a plain file name"):
        load_checkpoint(save_dir, TinyModel(0.0), None, None)


def test_iteration_in_common_state_must_match_the_directory(tmp_path: Path) -> None:
    save_dir, ckpt = _saved(tmp_path)
    ckpt.rename(get_checkpoint_name(save_dir, 7))
    (save_dir / "latest_checkpointed_iteration.txt").write_text("7\n")
    model = TinyModel(0.0)
    with pytest.raises(CheckpointingException, match="records iteration 1 but the directory is named for iteration 7"):
        load_checkpoint(save_dir, model, None, None)
    assert _untouched(model)


def _two_rank_save_then_load(directory: str) -> str:
    rank = torch.distributed.get_rank()
    shard = ShardedTensor.from_rank_offsets("w", torch.full((4, 3), float(rank)), (0, rank, 2))
    save({"w": shard}, directory)
    torch.distributed.barrier()
    if rank == 0:
        _flip_byte(Path(directory) / "__1_0.distcp")
    torch.distributed.barrier()
    target = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3), (0, rank, 2))
    try:
        load({"w": target}, directory, verify_checksums=True)
    except CheckpointingException as e:
        return str(e)
    return "loaded"


def test_corrupt_shard_of_another_rank_fails_the_load_on_every_rank(tmp_path: Path) -> None:
    messages = run_on_ranks(2, _two_rank_save_then_load, str(tmp_path / "c"))
    for message in messages:
        assert "__1_0.distcp is corrupt" in message, message
