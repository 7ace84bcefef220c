"""parallel_state's size/rank setters (Megatron-Core's way to fake a layout without groups), experts included."""

from __future__ import annotations

import pytest

from megatron_core import parallel_state as ps


@pytest.fixture(autouse=True)
def _clean():
    ps.destroy_model_parallel()
    yield
    ps.destroy_model_parallel()


def test_expert_setters_override_the_getters_and_none_drops_them():
    assert (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()) == (1, 0)
    ps.set_expert_model_parallel_world_size(4)
    ps.set_expert_model_parallel_rank(3)
    ps.set_expert_tensor_parallel_world_size(2)
    ps.set_expert_tensor_parallel_rank(1)
    assert (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()) == (4, 3)
    assert (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()) == (2, 1)
    ps.set_expert_model_parallel_world_size(None)
    ps.set_expert_model_parallel_rank(None)
    assert (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()) == (1, 0)


def test_expert_tensor_parallel_falls_back_to_the_tensor_parallel_override():
    # Megatron-Core: without an expert tensor-parallel group, the TP size/rank stand in for it.
    ps.set_tensor_model_parallel_world_size(4)
    ps.set_tensor_model_parallel_rank(2)
    assert (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()) == (4, 2)
    ps.set_expert_tensor_parallel_world_size(1)
    ps.set_expert_tensor_parallel_rank(0)
    assert (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()) == (1, 0)


def test_destroy_forgets_every_override():
    ps.set_expert_model_parallel_world_size(8)
    ps.set_expert_tensor_parallel_rank(5)
    ps.destroy_model_parallel()
    assert ps.get_expert_model_parallel_world_size() == 1
    assert ps.get_expert_tensor_parallel_rank() == 0
