"""``megatron_core.extensions.transformer_engine``: importable without TE, clear errors, TE binding.

Without Transformer Engine every layer raises ``ImportError`` naming the ``te`` extra. The binding
to TE's modules is checked with a small stand-in ``transformer_engine`` package (plain PyTorch
modules that record their constructor arguments), not with TE itself: it shows how Megatron's
arguments are mapped and that the wrappers subclass TE's classes, not that TE computes correctly.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from megatron_core.extensions import _te_loader
from megatron_core.extensions import transformer_engine as te_ext
from megatron_core.models.gpt import get_gpt_layer_with_transformer_engine_spec
from megatron_core.transformer import TransformerConfig

TE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None
LAYERS = ["TELinear", "TEColumnParallelLinear", "TERowParallelLinear", "TELayerNormColumnParallelLinear",
          "TEDotProductAttention", "TEGroupedLinear", "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear",
          "TEDelayedScaling", "TENorm"]


def _config(**overrides) -> TransformerConfig:
    kwargs = dict(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


@pytest.mark.skipif(TE_INSTALLED, reason="Transformer Engine is installed")
@pytest.mark.parametrize("name", LAYERS)
def test_layers_raise_import_error_naming_the_extra_without_te(name):
    assert te_ext.HAVE_TE is False
    with pytest.raises(ImportError, match=r"megatron-core-lite\[te\]") as info:
        getattr(te_ext, name)(_config(), 8, 8)
    assert name in str(info.value) or "TE" in str(info.value)


@pytest.mark.skipif(TE_INSTALLED, reason="Transformer Engine is installed")
def test_functions_without_te():
    context, sync = te_ext.get_cpu_offload_context(False, 2, 2, False, False, False)
    with context:
        t = torch.ones(2)
        assert sync(t) is t
    with pytest.raises(ImportError, match=r"megatron-core-lite\[te\]"):
        te_ext.get_cpu_offload_context(True, 2, 2, True, False, False)
    with pytest.raises(ImportError, match=r"megatron-core-lite\[te\]"):
        te_ext.te_checkpoint(lambda x: x, False, None, None, torch.ones(1))
    with pytest.raises(ImportError, match=r"\[te\]"):
        get_gpt_layer_with_transformer_engine_spec()


class _Recorder(torch.nn.Module):
    """Stand-in TE module: a plain linear that records its keyword arguments."""

    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs
        if "in_features" in kwargs:
            self.weight = torch.nn.Parameter(torch.ones(kwargs["out_features"], kwargs["in_features"]))

    def forward(self, x, is_first_microbatch=None):
        out = x @ self.weight.t()
        return (out, torch.zeros(out.shape[-1])) if self.kwargs.get("return_bias") else out


class _LayerNorm(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs


@pytest.fixture
def fake_te(monkeypatch):
    """A stand-in ``transformer_engine`` package in ``sys.modules`` (and a fresh binding cache)."""
    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.Linear = type("Linear", (_Recorder,), {})
    te.pytorch.LayerNormLinear = type("LayerNormLinear", (_Recorder,), {})
    te.pytorch.LayerNorm, te.pytorch.RMSNorm = type("LayerNorm", (_LayerNorm,), {}), type("RMSNorm", (_LayerNorm,), {})
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    _te_loader._bound.cache_clear()
    yield te
    _te_loader._bound.cache_clear()


def test_wrappers_bind_to_te_classes_with_megatron_arguments(fake_te):
    config = _config(add_bias_linear=False)
    layer = te_ext.TEColumnParallelLinear(8, 6, config=config, init_method=torch.nn.init.zeros_, gather_output=False,
                                          bias=False, skip_bias_add=False, is_expert=False)
    assert isinstance(layer, te_ext.TEColumnParallelLinear) and isinstance(layer, te_ext.TELinear)
    assert isinstance(layer, fake_te.pytorch.Linear)
    assert layer.kwargs["parallel_mode"] == "column" and layer.kwargs["tp_size"] == 1
    assert (layer.kwargs["in_features"], layer.kwargs["out_features"], layer.kwargs["return_bias"]) == (8, 6, False)
    out, bias = layer(torch.ones(3, 8))
    assert out.shape == (3, 6) and bias is None
    row = te_ext.TERowParallelLinear(6, 8, config=config, init_method=torch.nn.init.zeros_, bias=True,
                                     input_is_parallel=True, skip_bias_add=True, is_expert=False)
    assert row.kwargs["parallel_mode"] == "row" and row.kwargs["return_bias"] is True
    out, bias = row(torch.ones(2, 6))
    assert out.shape == (2, 8) and bias.shape == (8,)
    assert type(layer) is type(te_ext.TEColumnParallelLinear(  # the bound class is built once
        8, 6, config=config, init_method=torch.nn.init.zeros_, gather_output=False, bias=False,
        skip_bias_add=False, is_expert=False))


def test_wrapper_argument_rules(fake_te):
    config = _config()
    with pytest.raises(ValueError, match="gather_output"):
        te_ext.TEColumnParallelLinear(8, 6, config=config, init_method=None, gather_output=True, bias=False,
                                      skip_bias_add=False, is_expert=False)
    with pytest.raises(ValueError, match="input_is_parallel"):
        te_ext.TERowParallelLinear(8, 6, config=config, init_method=None, bias=False, input_is_parallel=False,
                                   skip_bias_add=False, is_expert=False)
    norm = te_ext.TENorm(_config(normalization="RMSNorm"), 8, eps=1e-6)
    assert isinstance(norm, fake_te.pytorch.RMSNorm) and norm.kwargs["eps"] == 1e-6
    fused = te_ext.TELayerNormColumnParallelLinear(8, 24, config=config, init_method=None, gather_output=False,
                                                   bias=True, skip_bias_add=False, is_expert=False)
    assert fused.kwargs["normalization"] == "LayerNorm" and fused.kwargs["parallel_mode"] == "column"


def test_te_attention_refuses_attention_sinks(fake_te):
    fake_te.pytorch.DotProductAttention = type("DotProductAttention", (_Recorder,), {})
    from megatron_core.transformer.enums import AttnMaskType

    with pytest.raises(ValueError, match="softmax_type='learnable'"):
        te_ext.TEDotProductAttention(_config(softmax_type="learnable"), 1, AttnMaskType.causal, "self")
