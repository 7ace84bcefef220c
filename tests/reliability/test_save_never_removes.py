"""``dist_checkpointing.save`` and ``save_checkpoint`` never remove what they did not write.

- a non-empty directory that is not a checkpoint is refused, naming what is in it, unless
  ``overwrite=True``;
- a regular file at the path is an error and is left untouched (not renamed aside);
- an empty directory, or one holding only leftovers of our own interrupted save, is saved into;
- ``save_checkpoint`` into a leftover ``iter_*`` directory holding a README refuses and keeps it;
- temporary directories of another program next to the checkpoint are not deleted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_core.dist_checkpointing import (
    CheckpointingException,
    ShardedTensor,
    check_is_distributed_checkpoint,
    load_plain_tensors,
    save,
)
from megatron_core.training import get_checkpoint_name, read_tracker, save_checkpoint
from tests.dist_checkpointing.crash_saver import TinyModel


def _state(value: float = 1.0) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), value)), "step": 3}


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_refuses_non_empty_directory_naming_its_contents(tmp_path: Path) -> None:
    target = tmp_path / "x"
    target.mkdir()
    (target / "notes.txt").write_text("keep")
    with pytest.raises(CheckpointingException, match=r"notes\.txt") as info:
        save(_state(), target)
    assert "overwrite=True" in str(info.value)
    assert (target / "notes.txt").read_text() == "keep"
    assert _siblings(target) == ["x"], "no temporary or moved-aside directory is left"


def test_overwrite_replaces_a_foreign_directory_when_asked(tmp_path: Path) -> None:
    target = tmp_path / "x"
    target.mkdir()
    (target / "notes.txt").write_text("keep")
    save(_state(2.0), target, overwrite=True)
    assert check_is_distributed_checkpoint(target)
    assert torch.equal(load_plain_tensors(target)["w"], torch.full((4,), 2.0))


def test_regular_file_at_the_path_is_an_error_and_untouched(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.write_text("precious")
    for overwrite in (False, True):
        with pytest.raises(CheckpointingException, match="not a directory"):
            save(_state(), target, overwrite=overwrite)
    assert target.read_text() == "precious"
    assert _siblings(target) == ["ckpt"], "the file is not renamed aside"


def test_empty_directory_and_own_leftovers_are_saved_into(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    save(_state(), empty)
    assert check_is_distributed_checkpoint(empty)
    leftover = tmp_path / "leftover"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"partial")  # an interrupted in-place save: our own file
    (leftover / "common.pt").write_bytes(b"partial")
    save(_state(5.0), leftover)
    assert torch.equal(load_plain_tensors(leftover)["w"], torch.full((4,), 5.0))


def test_complete_checkpoint_needs_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "c"
    save(_state(1.0), target)
    with pytest.raises(CheckpointingException, match="complete checkpoint"):
        save(_state(2.0), target)
    assert torch.equal(load_plain_tensors(target)["w"], torch.full((4,), 1.0))


def test_foreign_tmp_directory_next_to_the_checkpoint_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "c"
    other = tmp_path / "c.tmp-mine"
    other.mkdir()
    (other / "data.bin").write_text("someone else's")
    save(_state(), target)
    assert (other / "data.bin").read_text() == "someone else's"


def test_save_checkpoint_keeps_a_readme_in_a_leftover_iteration_directory(tmp_path: Path) -> None:
    save_dir = tmp_path / "run"
    save_checkpoint(save_dir, 4, TinyModel(1.0), None, None)
    leftover = get_checkpoint_name(save_dir, 5)
    leftover.mkdir()
    (leftover / "README").write_text("notes about step 5")
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    for overwrite in (False, True):
        with pytest.raises(CheckpointingException, match="README"):
            save_checkpoint(save_dir, 5, TinyModel(2.0), None, None, overwrite=overwrite)
    assert (leftover / "README").read_text() == "notes about step 5"
    assert read_tracker(save_dir) == 4
    (leftover / "README").unlink()  # only our own partial file is left: the save cleans it up
    save_checkpoint(save_dir, 5, TinyModel(2.0), None, None)
    assert read_tracker(save_dir) == 5 and check_is_distributed_checkpoint(leftover)
