"""``MoETransformerLayer`` computes what ``TransformerLayer`` computes, and its three MLP steps chain to the same.

Also: ``BaseTransformerLayer`` is the marker base of both (as in Megatron-Core), and a block fans a single
``MoETransformerLayer`` spec out to all its layers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron_core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron_core.transformer import TransformerBlock, TransformerConfig
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from megatron_core.transformer.transformer_layer import (
    BaseTransformerLayer,
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

FLAVOURS = {
    "softmax": dict(moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3),
    "sigmoid_shared": dict(moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                           moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True),
}


def _config(**overrides) -> TransformerConfig:
    cfg = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, num_moe_experts=4,
               moe_ffn_hidden_size=16, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def _spec(layer_cls: type, grouped: bool) -> ModuleSpec:
    return ModuleSpec(module=layer_cls, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm, mlp=get_moe_module_spec(use_te=False, num_experts=4,
                                                                     moe_grouped_gemm=grouped),
        mlp_bda=get_bias_dropout_add))


def _pair(config: TransformerConfig, grouped: bool) -> tuple[TransformerLayer, MoETransformerLayer]:
    torch.manual_seed(0)
    ref = _spec(TransformerLayer, grouped)(config=config, layer_number=1)
    torch.manual_seed(1)
    moe = _spec(MoETransformerLayer, grouped)(config=config, layer_number=1)
    moe.load_state_dict(ref.state_dict())
    return ref, moe


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def test_transformer_layers_derive_from_the_marker_base():
    config = _config()
    ref, moe = _pair(config, grouped=False)
    assert isinstance(ref, BaseTransformerLayer) and isinstance(moe, BaseTransformerLayer)
    assert isinstance(moe, TransformerLayer)
    assert moe.is_moe_layer and not moe.use_partial_cudagraphs
    assert ref.state_dict().keys() == moe.state_dict().keys()


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_moe_transformer_layer_equals_transformer_layer(flavour: str, grouped: bool):
    config = _config(**FLAVOURS[flavour])
    ref, moe = _pair(config, grouped)
    x = torch.randn(6, 2, 16)
    x_ref, x_moe = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, _ = ref(x_ref)
    out_moe, _ = moe(x_moe)
    torch.testing.assert_close(out_moe, out_ref, rtol=1e-6, atol=1e-6)
    (out_ref * torch.linspace(-1, 1, out_ref.numel()).view_as(out_ref)).sum().backward()
    (out_moe * torch.linspace(-1, 1, out_moe.numel()).view_as(out_moe)).sum().backward()
    torch.testing.assert_close(x_moe.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    ref_grads, moe_grads = _grads(ref), _grads(moe)
    assert ref_grads.keys() == moe_grads.keys() and ref_grads
    for name, grad in ref_grads.items():
        torch.testing.assert_close(moe_grads[name], grad, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("grouped", [False, True])
def test_the_three_mlp_steps_chain_to_the_layer_mlp(grouped: bool):
    config = _config(**FLAVOURS["sigmoid_shared"])
    ref, moe = _pair(config, grouped)
    hidden = torch.randn(6, 2, 16)
    h_ref, h_moe = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    expected = ref._forward_mlp(h_ref)
    residual, tokens, probs, shared = moe._forward_mlp_router(h_moe)
    output, bias = moe._forward_mlp_expert_compute(tokens, probs, [])
    got = moe._forward_mlp_postprocess(residual, output, shared, bias)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    expected.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(h_moe.grad, h_ref.grad, rtol=1e-6, atol=1e-6)
    for name, grad in _grads(ref).items():
        torch.testing.assert_close(_grads(moe)[name], grad, rtol=1e-6, atol=1e-6, msg=name)


def test_router_step_takes_a_padding_mask_like_the_layer():
    """A ``[b, s]`` padding mask reaches the router as in ``MoELayer.forward`` (padding tokens are not counted)."""
    config = _config(moe_router_topk=2, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    _, moe = _pair(config, grouped=False)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, 3:] = True
    moe._forward_mlp_router(torch.randn(6, 2, 16), padding_mask=mask)
    assert moe.mlp.router.local_tokens_per_expert.sum() == (12 - 3) * 2


def test_block_fans_a_single_moe_layer_spec_out():
    config = _config(num_layers=3, **FLAVOURS["softmax"])
    block = TransformerBlock(config, _spec(MoETransformerLayer, grouped=True))
    assert len(block.layers) == 3 and all(type(layer) is MoETransformerLayer for layer in block.layers)
    assert [layer.layer_number for layer in block.layers] == [1, 2, 3]
