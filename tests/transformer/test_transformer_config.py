"""TransformerConfig: derived defaults and validation errors that name fields, values and rule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_core.transformer import TransformerConfig


def _cfg(**kw):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=8)
    base.update(kw)
    return TransformerConfig(**base)


def test_derived_defaults():
    cfg = _cfg()
    assert cfg.ffn_hidden_size == 256
    assert cfg.kv_channels == 8
    assert cfg.num_query_groups == 8
    assert cfg.recompute_modules == ["core_attn"]
    assert cfg.activation_func is F.gelu and cfg.normalization == "LayerNorm"
    assert cfg.hidden_dropout == 0.1 and cfg.attention_dropout == 0.1 and cfg.add_bias_linear
    torch.manual_seed(0)
    w = torch.empty(4000)
    cfg.init_method(w)
    assert abs(w.std().item() - 0.02) < 2e-3
    cfg.output_layer_init_method(w)
    assert abs(w.std().item() - 0.02 / math.sqrt(2 * 4)) < 1e-3


def test_disable_bf16_reduced_precision_matmul_sets_the_torch_flag():
    flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, disable_bf16_reduced_precision_matmul=True)
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction  # only with bf16
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, bf16=True,
                          disable_bf16_reduced_precision_matmul=True)
        assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag


def test_query_key_scaling_forces_fp32_softmax():
    cfg = _cfg(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=False)
    assert cfg.attention_softmax_in_fp32


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (dict(num_attention_heads=12, hidden_size=96, tensor_model_parallel_size=8),
         ["num_attention_heads (12)", "tensor_model_parallel_size (8)"]),
        (dict(num_query_groups=3), ["num_attention_heads (8)", "num_query_groups (3)"]),
        (dict(num_query_groups=2, tensor_model_parallel_size=4), ["num_query_groups (2)", "tensor_model_parallel_size (4)"]),
        (dict(hidden_size=60), ["hidden_size (60)", "num_attention_heads (8)"]),
        (dict(sequence_parallel=True), ["sequence_parallel", "tensor_model_parallel_size"]),
        (dict(pipeline_model_parallel_size=2), ["pipeline_dtype", "pipeline_model_parallel_size=2"]),
        (dict(num_layers=0), ["num_layers (0)"]),
        (dict(normalization="BatchNorm"), ["normalization ('BatchNorm')"]),
        (dict(recompute_granularity="partial"), ["recompute_granularity ('partial')"]),
        (dict(recompute_granularity="full"), ["recompute_method", "None"]),
        (dict(recompute_granularity="full", recompute_method="uniform"), ["recompute_num_layers"]),
        (dict(recompute_granularity="selective", recompute_num_layers=2), ["recompute_num_layers (2)"]),
        (dict(recompute_granularity="selective", recompute_modules=["attn"]), ["['attn']"]),
        (dict(recompute_method="block"), ["recompute_method ('block')", "recompute_granularity"]),
        (dict(num_layers=5, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32),
         ["num_layers (5)", "pipeline_model_parallel_size (2)"]),
        (dict(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3,
              pipeline_dtype=torch.float32), ["num_layers (8)", "virtual_pipeline_model_parallel_size (3)"]),
        (dict(num_layers=7, pipeline_model_parallel_size=3, num_layers_in_first_pipeline_stage=2,
              pipeline_dtype=torch.float32), ["5 layers left", "2 middle"]),
        (dict(num_layers=4, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
              pipeline_model_parallel_layout="Et|ttL"), ["places 3 decoder layers", "num_layers is 4"]),
        (dict(num_layers=4, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
              pipeline_model_parallel_layout="Etx|ttL"), ["unknown symbols ['x']"]),
        (dict(expert_model_parallel_size=2), ["expert_model_parallel_size (2)", "num_moe_experts"]),
        (dict(num_moe_experts=4, moe_router_topk=5), ["moe_router_topk (5)"]),
        (dict(hidden_dropout=1.5), ["hidden_dropout (1.5)"]),
        (dict(fp16=True, bf16=True), ["fp16", "bf16"]),
    ],
)
def test_invalid_configs_raise_with_names_and_values(kwargs, fragments):
    with pytest.raises(ValueError) as info:
        _cfg(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_valid_parallel_configs():
    cfg = _cfg(tensor_model_parallel_size=4, num_query_groups=4, sequence_parallel=True)
    assert cfg.num_query_groups == 4
    cfg = _cfg(num_layers=6, pipeline_model_parallel_size=3, pipeline_dtype=torch.float32,
               num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=1)
    assert cfg.num_layers_in_first_pipeline_stage == 1
    cfg = _cfg(num_layers=4, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
               pipeline_model_parallel_layout="Et|t|t|tL")
    assert cfg.virtual_pipeline_model_parallel_size == 2
    cfg = _cfg(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert cfg.recompute_num_layers == 2
