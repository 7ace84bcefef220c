"""activations and fusions: forward against the reference formulas and gradients against unfused autograd."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_core import activations, jit, transformer
from megatron_core.fusions import fused_bias_dropout, fused_bias_geglu, fused_bias_gelu, fused_bias_swiglu
from megatron_core.fusions.fused_layer_norm import FusedLayerNorm
from megatron_core.transformer.transformer_config import TransformerConfig

torch.manual_seed(0)


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64) * 2


def test_activations_match_formulas():
    x = _x(64)
    torch.testing.assert_close(activations.squared_relu(x), torch.where(x > 0, x * x, torch.zeros_like(x)))
    torch.testing.assert_close(activations.quick_gelu(x), x / (1 + torch.exp(-1.702 * x)))
    torch.testing.assert_close(activations.fast_gelu(x), F.gelu(x, approximate="tanh"), rtol=1e-8, atol=1e-9)
    c = math.sqrt(2 / math.pi)
    torch.testing.assert_close(activations.fast_gelu(x), 0.5 * x * (1 + torch.tanh(c * (x + 0.044715 * x**3))),
                               rtol=1e-8, atol=1e-9)


def _check_against(fused_fn, reference_fn, *inputs):
    """Same forward and the same gradients for every input (upstream gradient random)."""
    a = [t.clone().requires_grad_() for t in inputs]
    b = [t.clone().requires_grad_() for t in inputs]
    out_a, out_b = fused_fn(*a), reference_fn(*b)
    torch.testing.assert_close(out_a, out_b, rtol=1e-7, atol=1e-8)
    g = torch.randn_like(out_b)
    out_a.backward(g)
    out_b.backward(g)
    for ta, tb in zip(a, b):
        torch.testing.assert_close(ta.grad, tb.grad, rtol=1e-6, atol=1e-7)


def test_bias_gelu_forward_and_backward():
    y, bias = _x(3, 5, 8), _x(8)
    _check_against(lambda y, b: fused_bias_gelu.bias_gelu_impl(y, b),
                   lambda y, b: F.gelu(y + b, approximate="tanh"), y, bias)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(6, 8), (3, 2, 8)])
def test_bias_swiglu_forward_and_backward(with_bias, shape):
    y, bias = _x(*shape), _x(shape[-1])

    def reference(y, b=None):
        z = y + b if b is not None else y
        z1, z2 = z.chunk(2, -1)
        return F.silu(z1) * z2

    if with_bias:
        _check_against(fused_bias_swiglu.bias_swiglu_impl, reference, y, bias)
        torch.testing.assert_close(fused_bias_swiglu.bias_swiglu(y, bias), reference(y, bias))
    else:
        _check_against(lambda y: fused_bias_swiglu.bias_swiglu_impl(y, None), reference, y)


@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_geglu_forward_and_backward(with_bias):
    y, bias = _x(3, 2, 8), _x(8)

    def reference(y, b=None):
        z = y + b if b is not None else y
        z1, z2 = z.chunk(2, -1)
        return F.gelu(z1, approximate="tanh") * z2

    if with_bias:
        _check_against(fused_bias_geglu.bias_geglu_impl, reference, y, bias)
    else:
        _check_against(lambda y: fused_bias_geglu.bias_geglu_impl(y, None), reference, y)


def test_quick_gelu_and_quick_geglu():
    y = _x(4, 8)
    torch.testing.assert_close(fused_bias_geglu.quick_gelu(y), y * torch.sigmoid(1.702 * y))
    y1, y2 = y.chunk(2, -1)
    torch.testing.assert_close(fused_bias_geglu.quick_geglu(y, 0.5), y1 * torch.sigmoid(1.702 * y1) * (y2 + 0.5))
    leaf = y.clone().requires_grad_()
    out = fused_bias_geglu.quick_geglu(leaf, 0.5)
    g = torch.randn_like(out)
    out.backward(g)
    torch.testing.assert_close(fused_bias_geglu.quick_geglu_back(g, y, 0.5), leaf.grad)


def test_swiglu_fp8_input_store_keeps_gradients_close():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 dtype")
    y = torch.randn(4, 8)
    a, b = y.clone().requires_grad_(), y.clone().requires_grad_()
    fused_bias_swiglu.bias_swiglu_impl(a, None, fp8_input_store=True).sum().backward()
    fused_bias_swiglu.bias_swiglu_impl(b, None).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0.15, atol=0.1)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="2-D or 3-D"):
        fused_bias_swiglu.bias_swiglu_impl(torch.zeros(8), None)
    with pytest.raises(ValueError, match="2-D or 3-D"):
        fused_bias_geglu.bias_geglu_impl(torch.zeros(1, 1, 1, 8), None)


def test_bias_dropout_add_names():
    assert transformer.get_bias_dropout_add is fused_bias_dropout.get_bias_dropout_add
    x, bias, residual = _x(2, 3, 4), _x(4), _x(2, 3, 4)
    expected = residual + x + bias
    torch.testing.assert_close(fused_bias_dropout.bias_dropout_add_fused_inference((x, bias), residual, 0.5), expected)
    torch.testing.assert_close(fused_bias_dropout.bias_dropout_add_fused_train((x, bias), residual, 0.0), expected)
    torch.testing.assert_close(fused_bias_dropout.bias_dropout_add_unfused(False)((x, None), residual, 0.3),
                               residual + x)
    torch.manual_seed(1)
    out = fused_bias_dropout.bias_dropout_add_fused_train((torch.ones(1000), None), torch.zeros(1000), 0.5)
    assert set(out.unique().tolist()) <= {0.0, 2.0} and 300 < int((out == 0).sum()) < 700


def test_fused_layer_norm_matches_torch():
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, sequence_parallel=False)
    norm = FusedLayerNorm(config, 8, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.2, 0.2)
    ref = torch.nn.LayerNorm(8, eps=1e-5).double()
    ref.load_state_dict(norm.state_dict())
    x = _x(3, 2, 8)
    _check_against(norm, ref, x)
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(8, dtype=torch.float64)) and not norm.bias.any()
    assert norm.weight.sequence_parallel is False
    with pytest.raises(ValueError, match="normalization"):
        FusedLayerNorm(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                         normalization="RMSNorm"), 8)


def test_jit_fuser_switch_applies_to_decorated_functions():
    calls = []

    @jit.jit_fuser
    def f(x):
        calls.append(1)
        return x + 1

    assert torch.equal(f(torch.zeros(2)), torch.ones(2))  # CPU: eager
    jit.disable_jit_fuser()
    try:
        assert not jit.is_jit_fuser_enabled()
        assert f(torch.zeros(1)).item() == 1.0
    finally:
        jit.enable_jit_fuser()
    assert jit.is_jit_fuser_enabled() and len(calls) == 2
    assert jit.noop_decorator(f) is f


def test_jit_fuser_inlines_into_an_enclosing_compiled_graph(monkeypatch):
    """Inside a traced graph the decorated functions are inlined: no nested compile, no graph break.

    The MoE experts' weighted SwiGLU (an autograd.Function over ``jit_fuser`` functions) broke a compiled
    layer's graph on torch 2.11 when the decorator set up its compiled function during the trace.
    """
    from megatron_core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    monkeypatch.setattr(jit, "_on_accelerator", lambda args, kwargs: True)  # take the GPU branch on CPU
    torch._dynamo.reset()
    compiled = torch.compile(lambda y, w: weighted_bias_swiglu_impl(y, None, w) + 0, backend="eager",
                             fullgraph=True)  # raises on a graph break
    y, w = torch.randn(6, 8, requires_grad=True), torch.rand(6, 1)
    out = compiled(y, w)
    y_ref = y.detach().clone().requires_grad_(True)
    gate, up = y_ref.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up * w
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(y.grad, y_ref.grad)
