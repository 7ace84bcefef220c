"""MegatronOptimizer._filter_and_reorder_param_groups: saved param groups are matched to the current ones by
param_group_identifier_keys (every ParamGroupOverride field plus the structural flags), not by position."""

from __future__ import annotations

import pytest

from megatron_core.optimizer.optimizer import MegatronOptimizer, _param_group_override_keys
from megatron_core.optimizer_param_scheduler import ParamGroupOverride


def test_identifier_keys_are_the_override_fields():
    assert set(_param_group_override_keys()) == set(ParamGroupOverride.__annotations__)


def test_groups_matched_by_identifier_not_position():
    current = [{"params": [], "max_lr": 1.0, "wd_mult": 1.0}, {"params": [], "max_lr": 2.0, "wd_mult": 1.0}]
    saved = [{"params": ["p0"], "max_lr": 2.0, "wd_mult": 1.0, "tag": "b"},
             {"params": ["p1"], "max_lr": 1.0, "wd_mult": 1.0, "min_lr": None, "tag": "a"}]
    out = MegatronOptimizer._filter_and_reorder_param_groups(current, saved)
    assert [g["tag"] for g in out] == ["a", "b"]
    assert [g["params"] for g in out] == [["p0"], ["p1"]]  # the saved state's ordering of params
    nemo = [{"params": [], "pre_wd_mult": 1.0, "max_lr": 1.0}]
    assert MegatronOptimizer._filter_and_reorder_param_groups(nemo, [dict(saved[1])])[0]["tag"] == "a"
    with pytest.raises(ValueError, match="Could not find parameter group"):
        MegatronOptimizer._filter_and_reorder_param_groups([{"params": [], "max_lr": 3.0}], saved)
