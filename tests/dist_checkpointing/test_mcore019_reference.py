"""Checkpoints written by megatron-core 0.19.2 (tests/data/mcore019_reference) load into ours.

0.19 stores the common state inside the DCP files (byte entry ``common_state/shard_0_1``) and
writes no ``common.pt``. The GPT checkpoints (GPT-2-like and Llama-like, TP=2) load strictly into
our GPTModel at TP=1 and TP=2 and reproduce 0.19's logits; the plain sharded state dict (TP=2;
tensors split on either axis, a replicated one, one with a prepended layer axis, per-rank objects,
common data) loads value for value at TP=1 and TP=2. A crafted ``common_state`` entry whose pickle
would run code fails without running it. The data's README says how it was made.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron_core import dist_checkpointing, parallel_state
from megatron_core.dist_checkpointing import CheckpointingException, ShardedObject
from megatron_core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron_core.dist_checkpointing.serialization import COMMON_STATE_UNIQUE_KEY, load_common_state_dict
from megatron_core.dist_checkpointing.strategies.torch_dist import TorchDistSaveShardedStrategy
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from tests.dist_checkpointing import mcore019_oracle as oracle
from tests.dist_harness import run_on_ranks

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "mcore019_reference"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
NAMES = sorted(MANIFEST["checkpoints"])
PLAIN = DATA / "plain_tp2"


def _model(name: str) -> GPTModel:
    variant = MANIFEST["variants"][MANIFEST["checkpoints"][name]["variant"]]
    config = dict(variant["config"])
    config["activation_func"] = getattr(torch.nn.functional, config.pop("activation"))
    torch.manual_seed(0)  # any initial weights: the checkpoint overwrites them
    return GPTModel(TransformerConfig(**config), get_gpt_layer_local_spec(), MANIFEST["vocab_size"],
                    MANIFEST["max_sequence_length"], **variant["model"]).eval()


def _logits_error(name: str) -> float:
    """Max |logits - 0.19's logits| after a strict load (TP size from parallel_state)."""
    model = _model(name)
    state = dist_checkpointing.load(model.sharded_state_dict(), str(DATA / name), strict="raise_all")
    model.load_state_dict(state, strict=True)
    spec = MANIFEST["input"]
    batch, seq = spec["batch"], spec["sequence_length"]
    generator = torch.Generator().manual_seed(spec["token_seed"])
    tokens = torch.randint(0, MANIFEST["vocab_size"], (batch, seq), generator=generator)
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    with torch.no_grad():
        logits = model(tokens, positions, mask)
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size > 1:
        pieces = [torch.empty_like(logits) for _ in range(size)]
        torch.distributed.all_gather(pieces, logits.contiguous(),
                                     group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(pieces, dim=-1)
    expected = torch.load(DATA / MANIFEST["checkpoints"][name]["logits"], weights_only=True)
    return (logits - expected).abs().max().item()


def test_reference_data_is_small_and_in_the_0_19_layout():
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert total < 400_000, f"{total} bytes of reference checkpoints"
    assert MANIFEST["writer"].startswith("megatron-core 0.19")
    for directory in [DATA / name for name in NAMES] + [PLAIN]:
        assert not (directory / "common.pt").exists()
        assert json.loads((directory / "metadata.json").read_text()) == {
            "sharded_backend": "torch_dist", "sharded_backend_version": 1}
        assert COMMON_STATE_UNIQUE_KEY in FileSystemReader(str(directory)).read_metadata().state_dict_metadata


@pytest.mark.parametrize("name", NAMES)
def test_megatron_core_019_gpt_loads_at_tp1_with_same_logits(name):
    assert _logits_error(name) < 1e-5


def _tp2_errors() -> dict[str, float]:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        return {name: _logits_error(name) for name in NAMES}
    finally:
        parallel_state.destroy_model_parallel()


def test_megatron_core_019_gpt_loads_at_tp2_with_same_logits():
    for errors in run_on_ranks(2, _tp2_errors):
        assert all(error < 1e-5 for error in errors.values()), errors


def _plain_load(tp: int) -> list[str]:
    rank = torch.distributed.get_rank()
    loaded = dist_checkpointing.load(oracle.build(dist_checkpointing, tp, rank, 0.0), str(PLAIN), strict="raise_all")
    return oracle.differences(loaded, oracle.expected_local(tp, rank, oracle.SCALE_THEIRS))


def test_megatron_core_019_plain_state_dict_loads_at_tp1_and_tp2():
    for tp in (1, 2):
        for problems in run_on_ranks(2, _plain_load, tp):
            assert problems == [], (tp, problems)
    common = load_common_state_dict(PLAIN)
    assert common["iteration"] == 7 and common["args"]["sizes"] == [1, 2, 3]
    assert torch.equal(common["common_tensor"], torch.arange(4))
    assert COMMON_STATE_UNIQUE_KEY in dist_checkpointing.load_sharded_metadata(str(PLAIN))


class _CreatesFile:
    """Unpickling this object calls ``open(path, 'w')``: it would create the marker file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_crafted_common_state_entry_is_not_executed(tmp_path):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(PLAIN, checkpoint)
    for path in checkpoint.iterdir():
        path.unlink()
    marker = tmp_path / "pwned"
    crafted = ShardedObject("common_state", {"iteration": 1, "payload": _CreatesFile(str(marker))}, (1,), (0,))
    request = TorchDistSaveShardedStrategy().save_request({"common_state": crafted}, checkpoint, stage=False)
    request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
    for finalize in request.finalize_fns:
        finalize()
    save_config(CheckpointingConfig("torch_dist", 1), checkpoint)
    with pytest.raises(CheckpointingException, match="common_state"):
        load_common_state_dict(checkpoint)
    with pytest.raises(CheckpointingException):
        dist_checkpointing.load({}, str(checkpoint))
    assert not marker.exists()
