"""Crash safety and safe loading.

- A real subprocess saving iteration 2 is killed with SIGKILL at three points of the save; the
  previous checkpoint and the tracker stay intact and loadable, and the next save succeeds.
- A model with another hidden size or layer count fails to load with the key and both shapes; a
  truncated data file fails with its name and nothing is copied into the model.
- Crafted ``.metadata`` and ``common.pt`` files whose pickles would create a marker file fail to
  load, and the marker file does not exist.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_core import dist_checkpointing
from megatron_core.dist_checkpointing import (
    CheckpointingException,
    load_common_state_dict,
    load_plain_tensors,
)
from megatron_core.training import (
    get_checkpoint_name,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
)
from tests.dist_checkpointing.crash_saver import TinyModel
from tests.dist_checkpointing.gpt_training import build
from tests.dist_harness import run_on_ranks
from tests.process_tree import kill_tree, readline_within

pytestmark = pytest.mark.slow  # SIGKILLed save processes

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("point", ["mid_write", "before_publish", "before_tracker"])
def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path, point):
    save_dir = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "tests.dist_checkpointing.crash_saver", str(save_dir), point],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = readline_within(proc, timeout=120)
        if line is None or line.strip() != "STALLED":
            pytest.fail(f"the saver did not report STALLED within 120 s: {line!r}\n{kill_tree(proc)[-3000:]}")
        if point == "before_tracker":
            assert get_checkpoint_name(save_dir, 2).is_dir()
        else:
            assert not get_checkpoint_name(save_dir, 2).exists()
            assert list(save_dir.glob("iter_0000002.tmp-*/*.distcp")), "the killed save had written data"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    assert read_tracker(save_dir) == 1
    model = TinyModel(0.0)
    state = load_checkpoint(save_dir, model, None, None)
    assert state["iteration"] == 1
    assert all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())

    save_checkpoint(save_dir, 2, TinyModel(3.0), None, None, overwrite=point == "before_tracker")
    assert read_tracker(save_dir) == 2
    assert not list(save_dir.glob("*.tmp-*")), "stale temporary directories are removed"
    assert torch.equal(load_plain_tensors(get_checkpoint_name(save_dir, 2))["a.weight"], torch.full((64, 64), 3.0))


def _mismatch(save_dir: str) -> dict:
    chunks, opt, sched = build(2, 1, num_layers=2)
    save_checkpoint(save_dir, 1, chunks, opt, sched)
    errors = {}
    for name, kw in {"hidden": dict(hidden=64, num_layers=2), "layers": dict(num_layers=4)}.items():
        from megatron_core import parallel_state

        parallel_state.destroy_model_parallel()
        chunks, opt, sched = build(2, 1, **kw)
        try:
            load_checkpoint(save_dir, chunks, opt, sched)
        except CheckpointingException as e:
            errors[name] = str(e)
        try:  # below the recorded architecture, the shapes are checked key by key
            dist_checkpointing.load(chunks[0].module.sharded_state_dict(), get_checkpoint_name(save_dir, 1))
        except CheckpointingException as e:
            errors[f"{name} shapes"] = str(e)
    return errors


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    errors = run_on_ranks(4, _mismatch, str(tmp_path / "ckpt"))[0]
    assert set(errors) == {"hidden", "layers", "hidden shapes", "layers shapes"}, errors
    assert "hidden_size is 32 in the checkpoint and 64 in the current model" in errors["hidden"], errors["hidden"]
    assert "num_layers is 2 in the checkpoint and 4 in the current model" in errors["layers"], errors["layers"]
    shapes = r"shape mismatch for key '([\w.]+)': checkpoint has global shape \(([\d, ]+)\), the model expects \(([\d, ]+)\)"
    key, saved, wanted = re.search(shapes, errors["hidden shapes"]).groups()
    assert saved.endswith("32") and wanted.endswith("64") and saved[:-2] == wanted[:-2], errors["hidden shapes"]
    key, saved, wanted = re.search(shapes, errors["layers shapes"]).groups()
    assert key.startswith("decoder.layers.") and saved.startswith("2,") and wanted.startswith("4,"), \
        errors["layers shapes"]


class _CreatesFile:
    """Unpickling this object calls ``open(path, 'w')``: it would create the marker file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("target", [".metadata", "common.pt"])
def test_crafted_pickle_is_not_executed(tmp_path, target):
    save_dir = tmp_path / "ckpt"
    save_checkpoint(save_dir, 1, TinyModel(1.0), None, None)
    checkpoint_dir = get_checkpoint_name(save_dir, 1)
    marker = tmp_path / "pwned"
    if target == ".metadata":
        (checkpoint_dir / target).write_bytes(pickle.dumps(_CreatesFile(str(marker))))
    else:
        torch.save({"iteration": 1, "payload": _CreatesFile(str(marker))}, checkpoint_dir / target)
    with pytest.raises(CheckpointingException, match=target.replace(".", r"\.")):
        load_checkpoint(save_dir, TinyModel(0.0), None, None)
    with pytest.raises(CheckpointingException):
        load_common_state_dict(checkpoint_dir) if target == "common.pt" else load_plain_tensors(checkpoint_dir)
    assert not marker.exists()


def test_truncated_data_file_is_reported_and_nothing_is_loaded(tmp_path):
    save_dir = tmp_path / "ckpt"
    save_checkpoint(save_dir, 1, TinyModel(1.0), None, None)
    (data_file,) = get_checkpoint_name(save_dir, 1).glob("*.distcp")
    data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])
    model = TinyModel(0.0)
    with pytest.raises(CheckpointingException, match=rf"{data_file.name}.*truncated"):
        load_checkpoint(save_dir, model, None, None)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in model.parameters())
