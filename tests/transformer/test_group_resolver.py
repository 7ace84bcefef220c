"""The one process-group resolver, single process: precedence, "no group" semantics, config checks.

Distributed behaviour (explicit groups, default sizes under TP/PP, contradictions under real
groups) is in tests/models/test_process_groups.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.distributed import collectives
from megatron_core.process_groups_config import (
    ProcessGroupCollection,
    check_parallel_size,
    resolve_pg_collection,
    resolve_process_group,
)
from megatron_core.transformer import TransformerConfig
from megatron_core.utils import get_pg_rank, get_pg_size, get_tensor_model_parallel_group_if_none


class _FakeGroup:
    """Stands in for a process group where only identity matters."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_nothing_initialised_means_no_group_of_size_one() -> None:
    assert not parallel_state.model_parallel_is_initialized()
    for role in ("tp", "pp", "cp", "dp", "dp_cp", "embd", "expt_tp", "mp"):
        assert resolve_process_group(role) is None
    assert (get_pg_size(None), get_pg_rank(None)) == (1, 0)
    pgs = resolve_pg_collection()
    assert isinstance(pgs, ProcessGroupCollection) and pgs.tp is None and pgs.dp_cp is None
    assert get_tensor_model_parallel_group_if_none(None) is None


def test_explicit_group_then_collection_then_parallel_state() -> None:
    tp, other = _FakeGroup("tp"), _FakeGroup("explicit")
    pgs = ProcessGroupCollection()
    pgs.tp = tp
    assert resolve_process_group("tp", pgs) is tp
    assert resolve_process_group("tp", pgs, group=other) is other
    # A collection's unset role means "no group", even where parallel_state would have one.
    assert resolve_process_group("pp", pgs) is None
    assert resolve_pg_collection(pgs) is pgs
    with pytest.raises(ValueError, match="unknown process group role 'tensor'"):
        resolve_process_group("tensor")


def test_config_field_defers_at_default_and_must_match_otherwise() -> None:
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4)
    assert check_parallel_size(config, "tensor_model_parallel_size", None, "tensor-parallel") == 1
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size is 2 but no group is set up \(size 1\)"):
        check_parallel_size(config, "tensor_model_parallel_size", None, "tensor-parallel")


def test_collectives_refuse_none_and_treat_local_as_one_process() -> None:
    with pytest.raises(ValueError, match="WORLD"):
        collectives.all_reduce(torch.ones(2), None)
    assert collectives.local_if_none(None) is collectives.LOCAL
    assert (collectives.group_size(collectives.LOCAL), collectives.group_rank(collectives.LOCAL)) == (1, 0)
    t = torch.arange(4.0)
    assert collectives.all_reduce(t, collectives.LOCAL) is None and torch.equal(t, torch.arange(4.0))
    out = torch.empty(4)
    collectives.all_gather(out, t, collectives.LOCAL)
    assert torch.equal(out, t)
    assert collectives.all_gather_object({"a": 1}, collectives.LOCAL) == [{"a": 1}]
