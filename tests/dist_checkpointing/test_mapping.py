"""ShardedTensor/ShardedObject metadata, factories and dict utilities (single process)."""

from __future__ import annotations

import pytest
import torch

from megatron_core.dist_checkpointing import (
    CheckpointingException,
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    apply_factories,
    apply_factory_merges,
    apply_fused_chunks_sharded_factory,
    apply_swiglu_sharded_factory,
)
from megatron_core.dist_checkpointing.dict_utils import diff, extract_matching_values, merge, without_matching


def test_from_rank_offsets_places_shard():
    data = torch.zeros(3, 4)
    sh = ShardedTensor.from_rank_offsets("w", data, (0, 2, 5), (2, 1, 4), (1, 1, 2), prepend_axis_num=1)
    assert sh.global_shape == (5, 6, 16)
    assert sh.global_offset == (2, 3, 4)
    assert sh.axis_fragmentations == (5, 2, 4)
    assert sh.local_shape == (3, 4)
    assert sh.chunk_sizes() == (1, 3, 4)
    assert sh.global_slice() == (2, slice(3, 6), slice(4, 8))
    assert sh.local_chunk_offset_in_global() == (2, 1, 1)
    assert sh.without_data().data is None


@pytest.mark.parametrize("offsets, match", [
    (((0, 2, 2),), "axis_rank_offset 2 not in"),
    (((3, 0, 2),), "axis 3 out of range"),
    (((0, 0, 2), (0, 1, 2)), "given twice"),
])
def test_from_rank_offsets_rejects_bad_offsets(offsets, match):
    with pytest.raises(CheckpointingException, match=match):
        ShardedTensor.from_rank_offsets("w", torch.zeros(2, 2), *offsets)


def test_shard_metadata_is_validated():
    with pytest.raises(CheckpointingException, match="data shape"):
        ShardedTensor("w", torch.zeros(2, 2), torch.float32, (2, 3), (2, 3), (0, 0), None)
    with pytest.raises(CheckpointingException, match="outside"):
        ShardedTensor("w", torch.zeros(2, 2), torch.float32, (2, 2), (3, 2), (2, 0), None)
    with pytest.raises(CheckpointingException, match="flattened_range"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(4), flattened_range=slice(0, 2))
    with pytest.raises(CheckpointingException, match="not inside grid"):
        ShardedObject("o", 1, (2,), (2,))


def test_sharded_object_unique_key_roundtrip():
    obj = ShardedObject("rng", {"a": 1}, (2, 4), (1, 3), replica_id=(0, 1))
    assert obj.unique_key == "rng/shard_1.3_2.4"
    back = ShardedObject.empty_from_unique_key(obj.unique_key)
    assert (back.key, back.global_shape, back.global_offset) == ("rng", (2, 4), (1, 3))


def test_swiglu_factory_builds_tp_independent_layout_and_merges():
    tp_size, ffn, hidden = 2, 4, 3
    full_gate = torch.arange(ffn * hidden, dtype=torch.float32).view(ffn, hidden)
    full_up = 100 + full_gate
    for tp_rank in range(tp_size):
        rows = slice(tp_rank * ffn // tp_size, (tp_rank + 1) * ffn // tp_size)
        local = torch.cat([full_gate[rows], full_up[rows]])
        sh = ShardedTensor.from_rank_offsets("fc1", local, (0, tp_rank, tp_size))
        sd = {"fc1": apply_swiglu_sharded_factory(sh)}
        factories = dict(sd)
        apply_factories(sd)
        gate_sh, up_sh = sd["fc1"]
        global_ref = torch.cat([full_gate, full_up])
        for piece in (gate_sh, up_sh):
            assert piece.global_shape == (2 * ffn, hidden)
            assert torch.equal(global_ref[piece.global_slice()], piece.data)
        merged = apply_factory_merges({"fc1": [gate_sh.data, up_sh.data]}, factories)
        assert torch.equal(merged["fc1"], local)


def test_fused_factory_with_unequal_chunks():
    q, k = torch.ones(4, 2), 2 * torch.ones(2, 2)
    sh = ShardedTensor.from_rank_offsets("qkv", torch.cat([q, k]), (0, 1, 2))
    pieces = apply_fused_chunks_sharded_factory(sh, [4, 2]).build()
    assert [p.global_offset for p in pieces] == [(4, 0), (8 + 2, 0)]
    with pytest.raises(CheckpointingException, match="do not add up"):
        apply_fused_chunks_sharded_factory(sh, [4, 1])


def test_extract_merge_keep_list_positions():
    st = ShardedTensor.from_rank_offsets("a", torch.zeros(1))
    sd = {"x": [st, 7, {"y": st, "z": 3}], "n": LocalNonpersistentObject(5), "only": {"s": st}}
    common = without_matching(sd, lambda v: isinstance(v, (ShardedTensor, LocalNonpersistentObject)))
    assert common == {"x": [None, 7, {"z": 3}]}
    matching, _ = extract_matching_values(sd, lambda v: isinstance(v, ShardedTensor), return_lists_as_dicts=True)
    assert set(matching) == {"x", "only"} and set(matching["x"]) == {0, 2}
    loaded = {"x": {0: "A", 2: {"y": "B"}}, "only": {"s": "C"}}
    assert merge(common, loaded) == {"x": ["A", 7, {"z": 3, "y": "B"}], "only": {"s": "C"}}


def test_diff_reports_paths():
    only_left, only_right, mismatch = diff({"a": 1, "b": torch.ones(2), "c": [1]}, {"a": 2, "b": torch.ones(2), "d": 0})
    assert only_left == [("c",)] and only_right == [("d",)]
    assert [m[0] for m in mismatch] == [("a",)]
