"""Megatron-Core arguments this implementation does not carry out raise when set, instead of being ignored."""

from __future__ import annotations

import pytest

from megatron_core import parallel_state, utils
from tests.dist_harness import run_on_ranks


@pytest.mark.parametrize("kwargs, match", [
    (dict(use_sharp=True), "use_sharp"),
    (dict(nccl_communicator_config_path="nccl.yaml"), "nccl_communicator_config_path"),
])
def test_initialize_refuses_unsupported_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        parallel_state.initialize_model_parallel(**kwargs)
    assert not parallel_state.model_parallel_is_initialized()


def test_global_memory_buffer_needs_initialisation():
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        parallel_state.get_global_memory_buffer()


def _tp_group_if_none() -> tuple[bool, bool, bool]:
    unchecked = utils.get_tensor_model_parallel_group_if_none(None, check_initialized=False) is None
    try:
        utils.get_tensor_model_parallel_group_if_none(None)
        raised = False
    except RuntimeError:
        raised = True
    parallel_state.initialize_model_parallel(2)
    try:
        found = utils.get_tensor_model_parallel_group_if_none(None) is parallel_state.get_tensor_model_parallel_group()
    finally:
        parallel_state.destroy_model_parallel()
    return unchecked, raised, found


def test_tp_group_if_none_honours_check_initialized():
    assert run_on_ranks(2, _tp_group_if_none) == [(True, True, True)] * 2
