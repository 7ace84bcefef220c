"""``dist_checkpointing.state_dict_utils``: the steps ``save`` and ``load`` take before storage."""

from __future__ import annotations

import pytest
import torch

from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factory_merges,
)
from megatron_core.dist_checkpointing.state_dict_utils import (
    filter_out_empty_flatten_tensor,
    load_preprocess,
    save_preprocess,
)


def _factory(key: str, data: torch.Tensor) -> ShardedTensorFactory:
    def build(k, t, replica_id, flattened_range):
        return {"x": ShardedTensor.from_rank_offsets(f"{k}.x", t[:2].clone()),
                "y": ShardedTensor.from_rank_offsets(f"{k}.y", t[2:].clone())}

    return ShardedTensorFactory(key, data, build, lambda sub: torch.cat([sub["x"], sub["y"]]))


def _state() -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.ones(3)),
        "f": _factory("f", torch.arange(4.0)),
        "obj": ShardedObject("obj", {"a": 1}, (1,), (0,)),
        "lst": [ShardedTensor.from_rank_offsets("l0", torch.zeros(2)), LocalNonpersistentObject("keep"), 5],
        "tmp": LocalNonpersistentObject(object()),
        "step": 7,
    }


def test_save_preprocess_splits_sharded_and_common_parts():
    sd = _state()
    sharded, common = save_preprocess(sd)
    assert isinstance(sd["f"], dict)  # factories are built in place
    assert sharded["w"].key == "w" and sharded["f"]["x"].key == "f.x" and sharded["obj"].key == "obj"
    assert [sh.key for sh in sharded["lst"]] == ["l0"]
    assert common == {"lst": [None, None, 5], "step": 7}


def test_save_preprocess_validates_and_preprocesses_common():
    seen = []

    def drop_step(common):
        seen.append(dict(common))
        return {k: v for k, v in common.items() if k != "step"}

    save_preprocess(_state(), True, drop_step)
    assert seen and seen[0]["step"] == 7
    bad = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(3)),
           "w2": ShardedTensor.from_rank_offsets("w", torch.ones(3))}
    with pytest.raises(CheckpointingException, match="main replica"):
        save_preprocess(bad)
    save_preprocess(bad, validate_access_integrity=False)


def test_load_preprocess_leaves_the_callers_dict_alone():
    sd = _state()
    factory = sd["f"]
    sharded, nonpersistent, factories = load_preprocess(sd)
    assert sd["f"] is factory and isinstance(sd["tmp"], LocalNonpersistentObject)
    assert sharded["f"]["y"].key == "f.y" and "tmp" not in sharded
    assert nonpersistent["lst"] == {1: "keep"} and not isinstance(nonpersistent["tmp"], LocalNonpersistentObject)
    assert factories["f"].data is None and factory.data is not None
    merged = apply_factory_merges({"f": {"x": torch.tensor([0.0, 1.0]), "y": torch.tensor([2.0, 3.0])}}, factories)
    assert torch.equal(merged["f"], torch.arange(4.0))


def test_filter_out_empty_flatten_tensor():
    empty = ShardedTensor.from_rank_offsets("e", torch.zeros(4))
    empty.flattened_range = slice(2, 2)  # legacy flattened shard holding nothing on this rank
    partial = ShardedTensor.from_rank_offsets("p", torch.zeros(4))
    partial.flattened_range = slice(0, 2)
    kept = filter_out_empty_flatten_tensor({"e": empty, "p": partial, "n": {"e2": empty}, "v": 3})
    assert kept == {"p": partial, "v": 3}
