"""Section 7, checks 2 and 4.

- (4) A GPT + optimizer checkpoint saved at (TP, PP, DP) = (2, 2, 1) on 4 ranks loads on fewer
  ranks, (1, 1, 1) on 1 rank and (2, 1, 1), (1, 2, 1) on 2 ranks: same logits (fp32, 1e-5) and a
  re-save holds bit-identical global tensors (model and every optimizer state).
- (2) The tracker is replaced atomically: a fault between the temporary write and the rename
  leaves the old value and no temporary file; an empty, truncated or non-integer tracker makes
  ``load_checkpoint`` raise naming the file instead of starting from scratch.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatron_core.dist_checkpointing import CheckpointingException, core, load_plain_tensors
from megatron_core.training import (
    get_checkpoint_name,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
)
from tests.dist_checkpointing.crash_saver import TinyModel
from tests.dist_checkpointing.test_gpt_resharding import _last_stage_logits, _load_target, _save_source
from tests.dist_harness import run_on_ranks


@pytest.mark.slow
def test_load_on_fewer_ranks_than_saved(tmp_path: Path) -> None:
    source = str(tmp_path / "source")
    reference = _last_stage_logits(run_on_ranks(4, _save_source, source, False))
    saved = load_plain_tensors(get_checkpoint_name(source, 3))
    for world, tp, pp in [(1, 1, 1), (2, 2, 1), (2, 1, 2)]:
        resave = str(tmp_path / f"w{world}_tp{tp}_pp{pp}")
        got = _last_stage_logits(run_on_ranks(world, _load_target, source, resave, tp, pp, world > 1, False))
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
        again = load_plain_tensors(get_checkpoint_name(resave, 3))
        assert again.keys() == saved.keys(), sorted(again.keys() ^ saved.keys())
        for key, value in saved.items():
            assert torch.equal(again[key], value), f"{key} changed after loading on {world} ranks (tp={tp} pp={pp})"


def test_fault_between_tracker_write_and_rename_keeps_the_old_value(tmp_path: Path, monkeypatch) -> None:
    save_checkpoint(tmp_path, 1, TinyModel(1.0), None, None)

    def fail(*_args, **_kwargs):
        raise OSError("injected fault before the rename")

    monkeypatch.setattr(core.os, "replace", fail)
    with pytest.raises(CheckpointingException, match="injected fault"):
        save_checkpoint(tmp_path, 2, TinyModel(2.0), None, None)
    monkeypatch.undo()
    assert read_tracker(tmp_path) == 1
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")], os.listdir(tmp_path)
    model = TinyModel(0.0)
    assert load_checkpoint(tmp_path, model, None, None)["iteration"] == 1
    assert all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())


@pytest.mark.parametrize("content", ["", "\n", "1\x00", "12abc", "-3", "one"], ids=repr)
def test_bad_tracker_raises_naming_the_file(tmp_path: Path, content: str) -> None:
    save_checkpoint(tmp_path, 1, TinyModel(1.0), None, None)
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text(content)
    with pytest.raises(CheckpointingException, match=str(tracker).replace(".", r"\.")):
        load_checkpoint(tmp_path, TinyModel(0.0), None, None)
    with pytest.raises(CheckpointingException, match="non-negative iteration number"):
        load_checkpoint(tmp_path, TinyModel(0.0), None, None, missing_ok=True)  # "if present" is no excuse
