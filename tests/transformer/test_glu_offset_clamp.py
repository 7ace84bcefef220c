"""GPT-OSS's gated activation (``glu_linear_offset``, ``activation_func_clamp_value``) against the direct formula
``act(min(gate, v)) * (clamp(up, -v, v) + offset)``: the dense MLP (also with bias_activation_fusion, whose fused
SwiGLU must not be taken) and both routed-expert layouts; the config rules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_core.activations import gated_linear_unit, quick_gelu
from megatron_core.fusions.fused_bias_geglu import quick_gelu as fused_quick_gelu
from megatron_core.inference.contexts.base_context import BaseInferenceContext
from megatron_core.models.backends import LocalSpecProvider
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.mlp import MLP
from megatron_core.transformer.spec_utils import build_module

H, FFN, EXPERTS = 8, 6, 3
CLAMP, OFFSET = 0.4, 1.0


def _config(**overrides) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FFN, gated_linear_unit=True,
                activation_func=quick_gelu, glu_linear_offset=OFFSET, activation_func_clamp_value=CLAMP,
                add_bias_linear=True, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                init_method_std=0.5)
    return TransformerConfig(**{**base, **overrides})


def _formula(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, act, offset: float, clamp: float | None):
    gate, up = (x @ w1.t() + b1).chunk(2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    return act(gate) * (up + offset)


def test_gated_linear_unit_formula():
    x = torch.linspace(-2, 2, 12).view(2, 6)
    gate, up = x.chunk(2, dim=-1)
    expected = gate.clamp(max=0.5) * torch.sigmoid(1.702 * gate.clamp(max=0.5)) * (up.clamp(-0.5, 0.5) + 1.0)
    torch.testing.assert_close(gated_linear_unit(x, quick_gelu, 1.0, 0.5), expected)
    torch.testing.assert_close(gated_linear_unit(x, F.silu), F.silu(gate) * up)


@pytest.mark.parametrize("act,fusion", [(quick_gelu, False), (fused_quick_gelu, True), (F.silu, True)])
def test_dense_mlp_matches_the_formula(act, fusion: bool):
    torch.manual_seed(0)
    offset = OFFSET if act is not F.silu else 0.0  # Megatron-Core: a fused GLU's offset needs quick_gelu
    config = _config(activation_func=act, bias_activation_fusion=fusion, glu_linear_offset=offset)
    mlp = MLP(config, get_gpt_layer_local_spec().submodules.mlp.submodules)
    x = torch.randn(5, 2, H, requires_grad=True)
    out, bias = mlp(x)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    hidden = _formula(x, fc1.weight, fc1.bias, act, offset, CLAMP)
    torch.testing.assert_close(out + bias, hidden @ fc2.weight.t() + fc2.bias, rtol=1e-5, atol=1e-5)
    assert (x @ fc1.weight.t() + fc1.bias).abs().max() > CLAMP  # the clamp is exercised
    out.sum().backward()
    assert x.grad is not None and fc1.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("grouped", [False, True])
def test_both_expert_layouts_match_the_formula(grouped: bool):
    torch.manual_seed(0)
    config = _config(num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN, moe_grouped_gemm=grouped)
    experts = build_module(LocalSpecProvider().grouped_mlp_modules(grouped), EXPERTS, config)
    counts = [3, 0, 4]
    x = torch.randn(sum(counts), H)
    probs = torch.rand(sum(counts))
    out, _ = experts(x, torch.tensor(counts), probs)
    expected, start = [], 0
    for e, n in enumerate(counts):
        if grouped:
            w1, b1 = experts.linear_fc1.weight[e], experts.linear_fc1.bias[e]
            w2, b2 = experts.linear_fc2.weight[e], experts.linear_fc2.bias[e]
        else:
            mlp = experts.local_experts[e]
            w1, b1, w2, b2 = mlp.linear_fc1.weight, mlp.linear_fc1.bias, mlp.linear_fc2.weight, mlp.linear_fc2.bias
        hidden = _formula(x[start:start + n], w1, b1, quick_gelu, OFFSET, CLAMP)
        expected.append(probs[start:start + n, None] * (hidden @ w2.t() + b2))
        start += n
    torch.testing.assert_close(out, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_config_rules_name_the_fields():
    with pytest.raises(ValueError, match="activation_func_clamp_value"):
        _config(activation_func_clamp_value=0.0)
    with pytest.raises(ValueError, match="glu_linear_offset.*gated_linear_unit=True"):
        _config(gated_linear_unit=False)
    with pytest.raises(ValueError, match="glu_linear_offset=1.0 needs activation_func=quick_gelu"):
        _config(activation_func=F.silu, bias_activation_fusion=True)
    with pytest.raises(ValueError, match="quick_gelu needs gated_linear_unit=True"):
        _config(gated_linear_unit=False, glu_linear_offset=0.0, activation_func_clamp_value=None,
                bias_activation_fusion=True)
    silu = _config(activation_func=F.silu)
    with pytest.raises(ValueError, match="glu_linear_offset"):  # the fused decode step would drop them
        BaseInferenceContext.check_attention_supported(SimpleNamespace(config=silu))
    BaseInferenceContext.check_attention_supported(SimpleNamespace(config=_config()))
