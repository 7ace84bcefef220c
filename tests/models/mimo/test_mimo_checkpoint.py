"""``dist_checkpointing`` of a MIMO model whose encoder and language model run on different TP x DP grids.

On 4 gloo ranks (no ``parallel_state``), fan-in (encoder TP=1 x DP=4, language model TP=2 x DP=2) and fan-out
(encoder TP=2 x DP=2, language model TP=1 x DP=4) models take their replica ids and TP offsets from each
module's own groups: every tensor's DP replica index is its rank in its module's DP group, each shard has
exactly one main replica, and ``dist_checkpointing.save`` / ``load`` into a freshly initialised model of the
same layout restores every parameter exactly. The checkpoint reloads into TP=1 x DP=4 for both modules (4
ranks) and into one process, giving the single-process model's weights.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from megatron_core import dist_checkpointing
from megatron_core.dist_checkpointing.dict_utils import nested_values
from megatron_core.dist_checkpointing.mapping import ShardedBase, apply_factories, is_main_replica
from tests.dist_harness import run_on_ranks
from tests.models.mimo import hetero_fixture as h

WORLD = 4
LAYOUTS = {"fan_in": (1, 4, 2, 2), "fan_out": (2, 2, 1, 4)}


def _zero_state() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in h.reference_state().items()}


def _replica_records(hetero: h.Hetero) -> list[tuple]:
    """``(key, global_offset, is_main)`` of every shard on this rank; asserts each DP replica index is the
    rank in the DP group of the shard's module."""
    sharded = hetero.model.sharded_state_dict()
    apply_factories(sharded)
    records = []
    for leaf in nested_values(sharded):
        if not isinstance(leaf, ShardedBase):
            continue
        want_dp = dist.get_rank(hetero.dp_group(leaf.key))
        assert leaf.replica_id[-1] == want_dp, f"{leaf.key}: replica_id {leaf.replica_id}, DP rank {want_dp}"
        records.append((leaf.key, tuple(leaf.global_offset), is_main_replica(leaf.replica_id)))
    return records


def _save_and_reload(layout: tuple[int, int, int, int], directory: str) -> list[tuple]:
    saved = h.build(*layout, h.reference_state())
    fresh = h.build(*layout, _zero_state())
    try:
        records = _replica_records(saved)
        dist_checkpointing.save(saved.model.sharded_state_dict(), directory)
        loaded = dist_checkpointing.load(fresh.model.sharded_state_dict(), directory)
        fresh.model.load_state_dict(loaded)
        for (name, want), (_, got) in zip(saved.model.named_parameters(), fresh.model.named_parameters()):
            assert torch.equal(got, want), name
        return records
    finally:
        h.destroy(saved)
        h.destroy(fresh)


def _reload_homogeneous(directory: str) -> None:
    """TP=1 x DP=4 for both modules: every rank holds the full single-process weights."""
    hetero = h.build(1, 4, 1, 4, _zero_state())
    try:
        loaded = dist_checkpointing.load(hetero.model.sharded_state_dict(), directory)
        hetero.model.load_state_dict(loaded)
        reference = h.reference_state()
        for name, param in hetero.model.named_parameters():
            assert torch.equal(param, reference[name]), name
    finally:
        h.destroy(hetero)


@pytest.mark.parametrize("direction", list(LAYOUTS))
def test_hetero_grids_save_one_main_replica_and_reload(tmp_path, direction):
    directory = str(tmp_path / direction)
    per_rank = run_on_ranks(WORLD, _save_and_reload, LAYOUTS[direction], directory)
    mains = Counter((key, offset) for records in per_rank for key, offset, main in records if main)
    shards = {(key, offset) for records in per_rank for key, offset, _ in records}
    assert set(mains) == shards, sorted(shards - set(mains))[:5]
    assert all(n == 1 for n in mains.values()), [s for s, n in mains.items() if n > 1][:5]
    assert any(key.startswith("modality_submodules.") for key, _ in shards)
    run_on_ranks(WORLD, _reload_homogeneous, directory)
    model = h.make(h.config())
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory))
    reference = h.reference_state()
    for name, param in model.named_parameters():
        assert torch.equal(param, reference[name]), name
