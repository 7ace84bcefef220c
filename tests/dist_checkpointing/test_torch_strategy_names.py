"""``strategies.torch``'s DCP translation names on 2 gloo ranks: a state dict written by ``dcp.save`` through
``mcore_to_pyt_state_dict`` + ``MCoreSavePlanner`` is read by our strategy, ours by ``dcp.load`` through
``MCoreLoadPlanner``; ``flatten_state_dict`` matches megatron-core's; ``.metadata`` files pickled with
megatron-core's ``MCoreMetadata`` / ``MCoreSavePlan`` read as plain DCP metadata."""

from __future__ import annotations

import pickle
import warnings
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan

from megatron_core.dist_checkpointing import save
from megatron_core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron_core.dist_checkpointing.safe_load import read_dcp_metadata
from megatron_core.dist_checkpointing.strategies.torch import (
    MSC_PREFIX,
    MCoreLoadPlanner,
    MCoreMetadata,
    MCoreSavePlan,
    MCoreSavePlanner,
    flatten_state_dict,
    mcore_to_pyt_state_dict,
    sharded_tensor_to_torch_sharded_tensor,
)
from megatron_core.dist_checkpointing.strategies.torch_dist import TorchDistLoadShardedStrategy
from tests.dist_harness import run_on_ranks

W = torch.arange(48.0).reshape(8, 6)
L = torch.arange(24.0).reshape(2, 3, 4)  # a stacked-layers tensor: axis 0 is a prepended axis


def _state(rank: int, empty: bool = False) -> dict:
    def value(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if empty else t.clone()

    return {
        "w": ShardedTensor.from_rank_offsets("w", value(W.chunk(2)[rank]), (0, rank, 2)),
        "layers": {"l": ShardedTensor.from_rank_offsets("layers", value(L[rank]), (0, rank, 2), prepend_axis_num=1)},
        "obj": ShardedObject("obj", None if empty else {"rank": rank}, (2,), (rank,)),
    }


def _grouped(sd: dict) -> dict:
    flat, _ = flatten_state_dict(sd)
    grouped = defaultdict(list)
    for sh in flat.values():
        grouped[sh.unique_key if isinstance(sh, ShardedObject) else sh.key].append(sh)
    return dict(grouped)


def _dcp_save_then_our_load(ckpt_dir: str) -> bool:
    rank = dist.get_rank()
    pyt = mcore_to_pyt_state_dict(_grouped(_state(rank)))
    dcp.save(pyt, storage_writer=FileSystemWriter(ckpt_dir), planner=MCoreSavePlanner(flatten_state_dict=False))
    dist.barrier()
    loaded = TorchDistLoadShardedStrategy().load(_state(rank, empty=True), ckpt_dir)
    return (torch.equal(loaded["w"], W.chunk(2)[rank]) and torch.equal(loaded["layers"]["l"], L[rank])
            and loaded["obj"] == {"rank": rank})


def test_dcp_save_through_mcore_planner_is_readable_by_torch_dist(tmp_path):
    assert all(run_on_ranks(2, _dcp_save_then_our_load, str(tmp_path / "ckpt")))


def _our_save_then_dcp_load(ckpt_dir: str) -> bool:
    rank = dist.get_rank()
    save(_state(rank), ckpt_dir)
    target = _state(rank, empty=True)
    grouped = _grouped(target)
    tensors = [sh for shards in grouped.values() for sh in shards if isinstance(sh, ShardedTensor)]
    pyt = mcore_to_pyt_state_dict(grouped, is_loading=True)
    dcp.load(pyt, storage_reader=FileSystemReader(ckpt_dir),
             planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=tensors))
    ok = torch.equal(target["w"].data, W.chunk(2)[rank]) and torch.equal(
        target["layers"]["l"].data.reshape(3, 4), L[rank])
    wrong = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 7), (0, rank, 2))
    with pytest.raises(CheckpointException, match="Global shape mismatch"):  # DCP wraps each rank's error
        dcp.load(mcore_to_pyt_state_dict({"w": [wrong]}, is_loading=True), storage_reader=FileSystemReader(ckpt_dir),
                 planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=[wrong]))
    return ok


def test_dcp_load_through_mcore_planner_reads_our_checkpoint(tmp_path):
    assert all(run_on_ranks(2, _our_save_then_dcp_load, str(tmp_path / "ckpt")))


def _torch_sharded_tensor() -> tuple:
    rank = dist.get_rank()
    sh = _state(rank)["layers"]["l"]
    pyt = sharded_tensor_to_torch_sharded_tensor([sh])
    offsets = [m.shard_offsets for m in pyt.metadata().shards_metadata]
    return tuple(pyt.size()), offsets, torch.equal(pyt.local_shards()[0].tensor[0], L[rank]), pyt.mcore_sh_ten.key


def test_sharded_tensor_to_torch_sharded_tensor():
    for size, offsets, same, key in run_on_ranks(2, _torch_sharded_tensor):
        assert size == (2, 3, 4) and offsets == [[0, 0, 0], [1, 0, 0]] and same and key == "layers"


def test_flatten_state_dict_matches_megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = pytest.importorskip("megatron.core.dist_checkpointing.strategies.torch")
    sd = {"a": {"b": torch.ones(2), "c": [torch.zeros(1), {"d": torch.ones(1)}]}, "e": [1, 2], "f": 3}
    ours = flatten_state_dict(sd)
    theirs = reference.flatten_state_dict(sd)
    assert ours[1] == theirs[1] and list(ours[0]) == list(theirs[0])
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        flatten_state_dict({"a": {"b": torch.ones(1)}, "a.b": torch.ones(1)})


def test_metadata_pickled_with_megatron_classes_reads_back(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = pytest.importorskip("megatron.core.dist_checkpointing.strategies.torch")
    ckpt = tmp_path / "ckpt"
    save({"w": ShardedTensor.from_rank_offsets("w", W.clone())}, ckpt)
    metadata = read_dcp_metadata(ckpt)
    legacy = reference.MCoreMetadata.__new__(reference.MCoreMetadata)
    legacy.__dict__.update(vars(metadata))
    plan = reference.MCoreSavePlan.__new__(reference.MCoreSavePlan)
    plan.__dict__.update(vars(SavePlan(items=[])))
    legacy.__dict__["all_local_plans"] = [plan]
    Path(ckpt / ".metadata").write_bytes(pickle.dumps(legacy))
    again = read_dcp_metadata(ckpt)
    assert isinstance(again, MCoreMetadata) and again.state_dict_metadata == metadata.state_dict_metadata
    assert isinstance(again.all_local_plans[0], MCoreSavePlan) and again.all_local_plans[0].items == []
    loaded = TorchDistLoadShardedStrategy().load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6))}, ckpt)
    assert torch.equal(loaded["w"], W) and MSC_PREFIX == "msc://"


def test_save_planner_refuses_deduplication_with_decentralized_plan():
    with pytest.raises(ValueError, match="dedup_replicated_tensors"):
        MCoreSavePlanner(dedup_replicated_tensors=True)
