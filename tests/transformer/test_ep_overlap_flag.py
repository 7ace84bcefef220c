"""overlap_moe_expert_parallel_comm and its companions: Megatron-Core's config rules (the schedule is tested in
tests/pipeline_parallel/test_combined_1f1b*.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe_validation import EPOverlapConfigError

BASE = dict(num_layers=1, hidden_size=128, num_attention_heads=4, num_moe_experts=2, expert_model_parallel_size=2,
            moe_token_dispatcher_type="alltoall", overlap_moe_expert_parallel_comm=True, bf16=True)


@pytest.mark.parametrize("mtp", [None, 0, 1])
def test_accepted_without_a_warning(mtp):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = TransformerConfig(**BASE, mtp_num_layers=mtp)
    assert config.overlap_moe_expert_parallel_comm is True and config.mtp_num_layers == mtp


def test_early_attn_memory_release_needs_the_overlap():
    config = TransformerConfig(**BASE, ep_overlap_early_attn_memory_release=True)
    assert config.ep_overlap_early_attn_memory_release is True
    with pytest.raises(EPOverlapConfigError, match="ep_overlap_early_attn_memory_release=True needs "
                                                   "overlap_moe_expert_parallel_comm=True"):
        TransformerConfig(**{**BASE, "overlap_moe_expert_parallel_comm": False},
                          ep_overlap_early_attn_memory_release=True)


def test_deferred_weight_gradients_follow_megatron_rules():
    assert TransformerConfig(**BASE, delay_wgrad_compute=True).delay_wgrad_compute is True
    no_overlap = {**BASE, "overlap_moe_expert_parallel_comm": False}
    assert TransformerConfig(**no_overlap, overlap_dispatch_backward_with_experts_wgrad=True) \
        .overlap_dispatch_backward_with_experts_wgrad is True
    cases = [
        (dict(no_overlap, delay_wgrad_compute=True),
         r"delay_wgrad_compute=True needs overlap_moe_expert_parallel_comm=True"),
        (dict(BASE, overlap_dispatch_backward_with_experts_wgrad=True),
         r"overlap_dispatch_backward_with_experts_wgrad=True needs overlap_moe_expert_parallel_comm=False"),
        (dict(no_overlap, overlap_dispatch_backward_with_experts_wgrad=True, delay_wgrad_compute=True),
         r"delay_wgrad_compute=True needs overlap_moe_expert_parallel_comm=True"),
    ]
    for kwargs, match in cases:
        with pytest.raises(EPOverlapConfigError, match=match):
            TransformerConfig(**kwargs)


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
