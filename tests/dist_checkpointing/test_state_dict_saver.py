"""``strategies.state_dict_saver`` on 2 gloo ranks: a DCP save split into plan, write and finalize loads back
equal (decentralized and coordinator-planned paths); repeated saves reuse the cached central plan without
collectives and a checkpoint's recorded plans let the next save reuse its metadata, as Megatron-Core's
``TorchDistSaveShardedStrategy.async_save`` drives them; a failed write fails every rank."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron_core.dist_checkpointing.safe_load import read_dcp_metadata
from megatron_core.dist_checkpointing.strategies import state_dict_saver as sds
from megatron_core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron_core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    get_async_strategy,
    mcore_to_pyt_state_dict,
)
from megatron_core.dist_checkpointing.strategies.torch_dist import TorchDistLoadShardedStrategy
from tests.dist_harness import run_on_ranks

W = torch.arange(48.0).reshape(8, 6)


def _sharded(rank: int, scale: float = 1.0, rows: int = 8) -> dict:
    w = (W[:rows] * scale).chunk(2)[rank].clone()
    return {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, 2)),
            "obj": ShardedObject("obj", {"rank": rank, "scale": scale}, (2,), (rank,))}


def _pyt(sharded: dict) -> dict:
    grouped = defaultdict(list)
    for sh in sharded.values():
        grouped[sh.unique_key if isinstance(sh, ShardedObject) else sh.key].append(sh)
    return mcore_to_pyt_state_dict(dict(grouped))


def _write(writer: FileSystemWriterAsync) -> None:
    fn, preload, args = writer.get_save_function_and_args()
    if fn is not None:
        preload()
        fn(*args)


def _loads_back(ckpt_dir: str, scale: float) -> bool:
    """The whole tensor read on every rank (another layout than the save's) equals ``W * scale``."""
    dist.barrier()
    whole = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6))}
    loaded = TorchDistLoadShardedStrategy().load(whole, ckpt_dir)
    obj = TorchDistLoadShardedStrategy().load(
        {"o": ShardedObject("obj", None, (2,), (1 - dist.get_rank(),))}, ckpt_dir)
    return torch.equal(loaded["w"], W * scale) and obj["o"] == {"rank": 1 - dist.get_rank(), "scale": scale}


def _save(ckpt_dir: str, scale: float, **kwargs) -> tuple:
    writer = FileSystemWriterAsync(ckpt_dir)
    ret = sds.save_state_dict_async_plan(_pyt(_sharded(dist.get_rank(), scale)), writer,
                                         planner=MCoreSavePlanner(flatten_state_dict=False), **kwargs)
    _write(writer)
    return ret


def _roundtrip(root: str) -> bool:
    (writer, metadata, group), _, _, validated, md_reuse = _save(f"{root}/dec", 2.0)
    sds.save_state_dict_async_finalize(writer, metadata, group)
    ok = _loads_back(f"{root}/dec", 2.0) and not validated and not md_reuse
    ok &= (metadata is not None) == (dist.get_rank() == 0)
    recorded = read_dcp_metadata(f"{root}/dec").all_local_plans
    ok &= len(recorded) == 2 and all(len(plan.items) == 2 for plan in recorded)

    # The coordinator-planned path (planner without a decentralized plan): rank-local keys, read by dcp.load.
    rank = dist.get_rank()
    writer = FileSystemWriterAsync(f"{root}/central")
    state = {f"t{rank}": torch.full((3,), float(rank)), "shared": torch.arange(4.0)}
    ret = sds.save_state_dict_async_plan(state, writer, planner=DefaultSavePlanner())
    _write(writer)
    sds.save_state_dict_async_finalize(*ret[0])
    dist.barrier()
    out = {f"t{rank}": torch.zeros(3), "shared": torch.zeros(4)}
    dcp.load(out, storage_reader=FileSystemReader(f"{root}/central"))
    return ok and torch.equal(out[f"t{rank}"], state[f"t{rank}"]) and torch.equal(out["shared"], torch.arange(4.0))


def test_plan_write_finalize_loads_back_equal(tmp_path):
    assert all(run_on_ranks(2, _roundtrip, str(tmp_path)))


def _planning_gathers(fn, *args, **kwargs) -> tuple:
    """``fn``'s result and how many object gathers it ran."""
    real = collectives.all_gather_object
    with mock.patch.object(collectives, "all_gather_object", side_effect=real) as gathers:
        out = fn(*args, **kwargs)
    return out, gathers.call_count


def _cached_plan_reuse(root: str) -> list:
    """Three saves driven as Megatron-Core's async_save drives them with ``use_cached_ckpt_structure``."""
    cached = (None, None, False)
    cached_metadata = None
    report = []
    for i in range(3):
        (ret, central, local, validated, _), gathers = _planning_gathers(
            _save, f"{root}/it{i}", float(i + 1), cached_ckpt_structure=cached)
        writer, metadata, group = ret
        if validated:
            if metadata is not None:
                cached_metadata = metadata
            elif group.is_coordinator:
                metadata = cached_metadata
        sds.save_state_dict_async_finalize(writer, metadata, group)
        report.append((validated, gathers, _loads_back(f"{root}/it{i}", float(i + 1))))
        cached = (central, local, validated)
    return report


def test_cached_central_plan_skips_planning_collectives(tmp_path):
    for report in run_on_ranks(2, _cached_plan_reuse, str(tmp_path)):
        # 1st: plans from scratch; 2nd: same central plan as cached (validated); 3rd: no gather while planning.
        assert [r[0] for r in report] == [False, True, True]
        assert report[0][1] == 1 and report[1][1] == 1 and report[2][1] == 0
        assert all(r[2] for r in report)


def _loaded_metadata_reuse(root: str) -> tuple:
    rank = dist.get_rank()
    ret = _save(f"{root}/first", 1.0)
    sds.save_state_dict_async_finalize(*ret[0])
    dist.barrier()
    loaded = read_dcp_metadata(f"{root}/first")
    (ret, *_, md_reuse), gathers = _planning_gathers(_save, f"{root}/second", 3.0,
                                                     loaded_all_plans=loaded.all_local_plans)
    writer, metadata, group = ret
    reused = md_reuse and metadata is None
    sds.save_state_dict_async_finalize(writer, loaded if rank == 0 else None, group)
    ok = reused and gathers == 0 and _loads_back(f"{root}/second", 3.0)

    # A different structure (fewer rows of w): the loaded plans do not match, so the plans are gathered anew.
    writer = FileSystemWriterAsync(f"{root}/third")
    ret = sds.save_state_dict_async_plan(_pyt(_sharded(rank, 1.0, rows=4)), writer,
                                         planner=MCoreSavePlanner(flatten_state_dict=False),
                                         loaded_all_plans=loaded.all_local_plans)
    _write(writer)
    sds.save_state_dict_async_finalize(*ret[0])
    ok &= ret[4] is False and (ret[0][1] is not None) == (rank == 0)
    group = sds.PlanningGroup()
    ok &= sds.verify_global_md_reuse(loaded.all_local_plans[:1], ret[2], rank, group) is False
    ok &= sds.verify_global_md_reuse(None, ret[2], rank, group) is False
    return ok


def test_loaded_metadata_reuse_verified_on_every_rank(tmp_path):
    assert all(run_on_ranks(2, _loaded_metadata_reuse, str(tmp_path)))


def _failed_write(root: str) -> bool:
    writer = FileSystemWriterAsync(f"{root}/c")
    ret = sds.save_state_dict_async_plan(_pyt(_sharded(dist.get_rank())), writer,
                                         planner=MCoreSavePlanner(flatten_state_dict=False))
    if dist.get_rank() == 0:  # rank 1 never runs its write function
        _write(writer)
    with pytest.raises(CheckpointException) as info:
        sds.save_state_dict_async_finalize(*ret[0])
    failing = set(info.value.failures)
    return failing == ({1} if dist.get_rank() == 0 else set()) and not Path(f"{root}/c/.metadata").exists()


def test_failed_write_raises_on_every_rank(tmp_path):
    assert all(run_on_ranks(2, _failed_write, str(tmp_path)))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_single_process_and_async_strategy_modules(tmp_path):
    writer = FileSystemWriterAsync(tmp_path / "c")
    state = {"a": torch.arange(5.0)}
    ret = sds.save_state_dict_async_plan(state, writer)
    _write(writer)
    sds.save_state_dict_async_finalize(*ret[0])
    out = {"a": torch.zeros(5)}
    dcp.load(out, checkpoint_id=tmp_path / "c", no_dist=True)
    assert torch.equal(out["a"], state["a"])
    _, modules = get_async_strategy("mcore")
    assert modules["save_state_dict_async_plan"] is sds.save_state_dict_async_plan
    assert modules["save_state_dict_async_finalize"] is sds.save_state_dict_async_finalize
