"""``megatron_fsdp.uneven_dtensor`` on 2 gloo ranks: DTensors whose shards are not ``torch.chunk``'s sizes.

A state dict of such DTensors (one rank's shard empty, one sharded along columns, one nested like optimizer
state) is preprocessed, saved with DCP, and loaded into DTensors cut differently: every value comes back
exactly. On a 2x2 mesh (the even layouts DTensor makes), nested ``Shard`` / ``_StridedShard`` placements find
each shard where it really lies.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from megatron_core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
    filter_unflattened_state_dict,
    gather_and_compute_chunk_metadata,
    get_unflattened_state_dict,
    preprocess_state_dict_for_uneven_dtensor,
    uneven_dtensor_to_full_tensor,
    validate_uneven_dtensor,
)
from tests.dist_harness import run_on_ranks

FULL = {
    "w": torch.arange(32, dtype=torch.float32).reshape(8, 4),
    "cols": torch.arange(21, dtype=torch.float32).reshape(3, 7) * -1.5,
    "exp_avg": torch.arange(10, dtype=torch.float64) / 7,
}
DIMS = {"w": 0, "cols": 1, "exp_avg": 0}


def _uneven(mesh, name: str, sizes: list[int], zeros: bool = False) -> DTensor:
    """This rank's piece (``sizes[rank]`` along the sharded dim) of ``FULL[name]`` as a DTensor."""
    full, dim, rank = FULL[name], DIMS[name], dist.get_rank()
    local = full.narrow(dim, sum(sizes[:rank]), sizes[rank]).clone()
    if zeros:
        local.zero_()
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride())


def _state_dict(mesh, layout: dict[str, list[int]], zeros: bool = False) -> dict:
    return {
        "model": {"w": _uneven(mesh, "w", layout["w"], zeros), "cols": _uneven(mesh, "cols", layout["cols"], zeros),
                  "bias": torch.zeros(3) if zeros else torch.ones(3)},
        "optimizer": {"state": {"0": {"exp_avg": _uneven(mesh, "exp_avg", layout["exp_avg"], zeros)}}, "step": 5},
    }


def _roundtrip(path: str) -> bool:
    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    saved = _state_dict(mesh, {"w": [3, 5], "cols": [7, 0], "exp_avg": [1, 9]})
    assert preprocess_state_dict_for_uneven_dtensor(saved) is saved
    (chunk,) = saved["model"]["w"].__create_chunk_list__()
    assert (tuple(chunk.offsets), tuple(chunk.sizes)) == [((0, 0), (3, 4)), ((3, 0), (5, 4))][rank]
    (chunk,) = saved["model"]["cols"].__create_chunk_list__()
    assert (tuple(chunk.offsets), tuple(chunk.sizes)) == [((0, 0), (3, 7)), ((0, 7), (3, 0))][rank]
    for name, value in [("w", saved["model"]["w"]), ("cols", saved["model"]["cols"])]:
        validate_uneven_dtensor(value)
        assert torch.equal(uneven_dtensor_to_full_tensor(value), FULL[name])
    dcp.save(saved, checkpoint_id=path)

    loaded = _state_dict(mesh, {"w": [6, 2], "cols": [2, 5], "exp_avg": [10, 0]}, zeros=True)
    preprocess_state_dict_for_uneven_dtensor(loaded)
    dcp.load(loaded, checkpoint_id=path)
    expected = _state_dict(mesh, {"w": [6, 2], "cols": [2, 5], "exp_avg": [10, 0]})
    for key_path in filter_unflattened_state_dict(expected, visit_condition=lambda v: isinstance(v, DTensor)):
        got = get_unflattened_state_dict(loaded, key_path).to_local()
        want = get_unflattened_state_dict(expected, key_path).to_local()
        assert got.dtype == want.dtype and torch.equal(got, want), key_path
    assert torch.equal(loaded["model"]["bias"], torch.ones(3)) and loaded["optimizer"]["step"] == 5
    return True


def _bad_shapes() -> str:
    mesh = init_device_mesh("cpu", (2,))
    local = torch.zeros(3, 2)  # 3 + 3 rows on the ranks, but the DTensor claims 8
    dtensor = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(8, 2), stride=(2, 1))
    with pytest.raises(ValueError, match=r"do not reach both ends") as info:
        validate_uneven_dtensor(dtensor)
    return str(info.value)


def _nested_offsets() -> list[bool]:
    """On a 2x2 mesh: where each rank's shard really lies in the global tensor, for nested placements."""
    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    found = []
    for placements in [(Shard(0), Shard(0)), (Shard(0), Shard(1)), (Replicate(), Shard(0)),
                       (_StridedShard(0, split_factor=2), Shard(0))]:
        dtensor = distribute_tensor(full, mesh, list(placements))
        chunk = gather_and_compute_chunk_metadata(dtensor)
        region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
        found.append(torch.equal(full[region], dtensor.to_local())
                     and torch.equal(uneven_dtensor_to_full_tensor(dtensor), full))
    return found


def test_nested_placements_find_each_shards_true_offset():
    assert run_on_ranks(4, _nested_offsets) == [[True] * 4] * 4


def test_uneven_dtensor_state_dict_survives_a_dcp_roundtrip_into_another_layout(tmp_path):
    assert run_on_ranks(2, _roundtrip, str(tmp_path)) == [True, True]


def test_validate_refuses_shards_that_do_not_cover_the_global_shape():
    assert all("(8, 2)" in message for message in run_on_ranks(2, _bad_shapes))


def test_state_dict_walkers_name_the_missing_path():
    sd = {"a": {"b": 1, "c": {"d": 2}}, "e": 3}
    assert filter_unflattened_state_dict(sd, visit_condition=lambda v: v >= 2) == [["a", "c", "d"], ["e"]]
    assert get_unflattened_state_dict(sd, ["a", "c", "d"]) == 2
    with pytest.raises(KeyError, match=r"\['a', 'x'\]"):
        get_unflattened_state_dict(sd, ["a", "x"])
    with pytest.raises(TypeError, match="needs a DTensor"):
        uneven_dtensor_to_full_tensor(torch.zeros(2))
