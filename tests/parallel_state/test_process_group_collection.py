"""ProcessGroupCollection: Megatron-Core's repr (roles with sizes), the hcp role, and the invalid-role error."""

from __future__ import annotations

from unittest import mock

import pytest
import torch.distributed as dist

from megatron_core import parallel_state as ps
from megatron_core.process_groups_config import ProcessGroupCollection


def _group(size):
    group = mock.Mock(spec=dist.ProcessGroup)
    group.size.return_value = size
    return group


def test_repr_lists_the_roles_that_hold_groups():
    assert repr(ProcessGroupCollection()) == "ProcessGroupCollection(empty)"
    pgs = ProcessGroupCollection(tp=_group(4), pp=_group(2))
    pgs.hcp = [_group(2), _group(4)]
    assert repr(pgs) == "ProcessGroupCollection(tp(4), pp(2), hcp([2, 4]))"


def test_use_mpu_process_groups_names_invalid_roles():
    with pytest.raises(ValueError, match=r"Invalid process groups requested: \['foo'\]"):
        ProcessGroupCollection.use_mpu_process_groups(["tp", "foo"])


def test_hcp_is_read_from_parallel_state():
    ps.destroy_model_parallel()
    assert ProcessGroupCollection.use_mpu_process_groups(["hcp"]).hcp is None


def test_all_gather_groups_default_to_none():
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    assert pgs.dp_cp_ag is None and pgs.expt_dp_ag is None
    assert ProcessGroupCollection(dp_cp_ag=_group(2)).dp_cp_ag.size() == 2
