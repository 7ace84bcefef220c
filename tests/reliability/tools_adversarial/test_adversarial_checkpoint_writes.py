"""A training checkpoint save interrupted at each write step (disk full, short write): a clear error, and the
previous checkpoint and the tracker intact and loadable."""

from __future__ import annotations

import errno

import pytest
import torch

from megatron_core.dist_checkpointing import CheckpointingException, manifest, serialization
from megatron_core.training import checkpointing, load_checkpoint, read_tracker, save_checkpoint
from tests.dist_checkpointing.crash_saver import TinyModel
from tests.reliability.tools_adversarial.conftest import fingerprint


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _short_write(*args, **kwargs):
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def _inject(monkeypatch, step: str) -> None:
    if step == "temporary-directory":
        monkeypatch.setattr(serialization, "remove_stale_tmp_dirs", _no_space)
    elif step == "common-state":
        monkeypatch.setattr(serialization, "_serialize_common", _no_space)
    elif step in ("data-file", "data-file-short-write"):
        real, written = manifest._HashingWriter.write, [0]

        def write(self, data):
            written[0] += len(data)
            if written[0] > 1024:
                (_no_space if step == "data-file" else _short_write)()
            return real(self, data)

        monkeypatch.setattr(manifest._HashingWriter, "write", write)
        monkeypatch.setattr("megatron_core.dist_checkpointing.disk_space.shutil.disk_usage",
                            lambda path: __import__("shutil")._ntuple_diskusage(10**6, 10**6, 0))
    elif step == "manifest":
        monkeypatch.setattr(serialization, "write_manifest", _no_space)
    elif step == "metadata-json":
        monkeypatch.setattr(serialization, "save_config", _no_space)
    elif step == "publish":
        monkeypatch.setattr(serialization, "replace_target", _no_space)
    elif step == "tracker":
        monkeypatch.setattr(checkpointing, "write_tracker", _no_space)


STEPS = ["temporary-directory", "common-state", "data-file", "data-file-short-write", "manifest", "metadata-json",
         "publish", "tracker"]


@pytest.mark.parametrize("step", STEPS)
def test_save_interrupted_at_each_step(tmp_path, monkeypatch, step) -> None:
    save = tmp_path / "ckpt"
    save_checkpoint(save, 1, TinyModel(1.0), None, None)
    before = fingerprint(save)
    _inject(monkeypatch, step)
    with pytest.raises(CheckpointingException) as caught:
        save_checkpoint(save, 2, TinyModel(2.0), None, None)
    message = str(caught.value)
    assert "no space left on device" in message and str(save) in message, message
    monkeypatch.undo()
    after = fingerprint(save)
    if step == "tracker":  # the new directory is complete but unpublished: the tracker still names 1
        after = {k: v for k, v in after.items() if not k.startswith("iter_0000002")}
    assert after == before
    model = TinyModel(0.0)
    load_checkpoint(str(save), model, None, None, load_rng=False)
    assert read_tracker(save) == 1 and torch.equal(model.a.weight, torch.ones(64, 64))
    save_checkpoint(save, 2, TinyModel(2.0), None, None, overwrite=True)  # the next save succeeds
    assert read_tracker(save) == 2


def test_asynchronous_save_on_a_full_disk(tmp_path, monkeypatch) -> None:
    from megatron_core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    save = tmp_path / "ckpt"
    save_checkpoint(save, 1, TinyModel(1.0), None, None)
    _inject(monkeypatch, "data-file")
    queue = AsyncCallsQueue()
    try:
        save_checkpoint(save, 2, TinyModel(2.0), None, None, async_queue=queue)
        with pytest.raises(CheckpointingException, match="no space left on device"):
            queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    assert read_tracker(save) == 1 and not (save / "iter_0000002").exists()
