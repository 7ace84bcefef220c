"""``megatron-generate``'s checkpoint load reads each file of the checkpoint once (issue #40).

The tracker, ``metadata.json``, DCP's ``.metadata`` and the common state are read once and what
was read is passed down (the common state and the load strategy, which keeps the metadata).
Opens are counted with the ``open`` audit event, parses by wrapping the readers.
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.dist_checkpointing import serialization
from megatron_core.dist_checkpointing.strategies import torch_dist
from megatron_core.inference.cli import checkpoint as loader

REPO = Path(__file__).resolve().parents[2]
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")

_recording: list[collections.Counter] = []
_hooked: list[bool] = []


def _count_opens(event: str, args: tuple) -> None:
    """Audit hook (it cannot be removed): counts the files opened while a test holds a counter in ``_recording``."""
    if _recording and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _recording[-1][os.path.basename(os.fsdecode(args[0]))] += 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A checkpoint of a tiny GPT after 2 steps (``pretrain_gpt.py`` in this process)."""
    if dist.is_initialized():
        pytest.skip("a process group from another test is still up")
    saved = {k: os.environ.pop(k) for k in ENV if k in os.environ}
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import pretrain_gpt

        save = tmp_path_factory.mktemp("reads") / "ckpt"
        assert pretrain_gpt.main([
            "--model-preset", "tiny", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--mock-data", "--vocab-size", "64", "--micro-batch-size", "1",
            "--train-iters", "2", "--eval-iters", "0", "--save", str(save), "--no-progress"]) == 0
    finally:
        sys.path.remove(str(REPO / "examples"))
        for k in ENV:
            os.environ.pop(k, None)
        os.environ.update(saved)
    return save


def test_one_load_reads_each_checkpoint_file_once(trained, monkeypatch) -> None:
    counts: collections.Counter = collections.Counter()

    def counted(module, name: str, label: str) -> None:
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[label] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(serialization, "_read_common_state", "common state")
    counted(torch_dist, "read_dcp_metadata", ".metadata parsed")
    if not _hooked:
        sys.addaudithook(_count_opens)
        _hooked.append(True)
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    loader.init_distributed_for_inference()
    try:
        _recording.append(counts)
        try:
            model, _, args = loader.load_gpt_from_checkpoint(str(trained))
        finally:
            _recording.pop()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        for name in ENV:  # set by init_distributed_for_inference; rank pools spawned later would inherit them
            os.environ.pop(name, None)
    assert model.vocab_size >= 64 and args["train_iters"] == 2
    assert counts["latest_checkpointed_iteration.txt"] == 1, counts
    assert counts["metadata.json"] == 1, counts
    assert counts[".metadata parsed"] == 1, counts
    assert counts["common state"] == 1 and counts["common.pt"] == 0, counts
