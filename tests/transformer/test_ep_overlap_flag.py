"""overlap_moe_expert_parallel_comm: accepted with Megatron-Core's checks and a warning (no overlap here)."""

from __future__ import annotations

import pytest
import torch

from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe_validation import EPOverlapConfigError

BASE = dict(num_layers=1, hidden_size=128, num_attention_heads=4, num_moe_experts=2, expert_model_parallel_size=2,
            moe_token_dispatcher_type="alltoall", overlap_moe_expert_parallel_comm=True, bf16=True)


@pytest.mark.parametrize("mtp", [None, 0, 1])
def test_accepted_with_a_warning(mtp):
    with pytest.warns(UserWarning, match="no effect in this library"):
        config = TransformerConfig(**BASE, mtp_num_layers=mtp)
    assert config.overlap_moe_expert_parallel_comm is True and config.mtp_num_layers == mtp


@pytest.mark.parametrize("change, match", [
    (dict(mtp_num_layers=2), "MTP supports at most one layer"),
    (dict(mtp_num_layers=-1), "MTP supports at most one layer"),
    (dict(expert_model_parallel_size=1), "expert model parallelism"),
    (dict(moe_token_dispatcher_type="allgather"), "alltoall or flex"),
    (dict(bf16=False), "bf16 or fp16"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), "full recomputation"),
    (dict(pipeline_model_parallel_size=2, num_layers=2, pipeline_dtype=torch.bfloat16), "virtual_pipeline_model_parallel_size must be set"),
])
def test_megatron_rules(change, match):
    with pytest.raises(EPOverlapConfigError, match=match) as info:
        TransformerConfig(**{**BASE, **change})
    assert isinstance(info.value, AssertionError) and isinstance(info.value, ValueError)


def test_zero_mtp_layers_means_no_mtp():
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, mtp_num_layers=0)
    assert not config.mtp_num_layers
