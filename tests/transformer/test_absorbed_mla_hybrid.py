"""The hybrid specs' ``D`` (absorbed MLA + DeepSeek sparse attention) and ``+`` (MLA) layers, fp32 CPU.

Each layer is ``x + attention(input_norm(x))``: checked against that sum written out with standard
``MLASelfAttention`` on the same weights (DSA core for ``D``, dense causal for ``+``), output and input gradient.
A ``HybridModel`` with ``D`` and MLP layers trains a step; ``qk_layernorm=False`` is refused naming the field.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention
from megatron_core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from tests.transformer.absorbed_mla_common import TOL, mla_config, perturb_norms, standard_attention_spec
from tests.transformer.experimental_attention_variant.dsa_common import dsa_config, reset_dsa_globals


def _hybrid_layer(slot: str, cfg) -> torch.nn.Module:
    torch.manual_seed(4)
    layer = build_module(getattr(hybrid_stack_spec.submodules, slot), config=cfg, layer_number=1)
    perturb_norms(layer)
    with torch.no_grad():
        layer.input_layernorm.weight.add_(0.1)
    return layer


def _reference_attention(slot: str, cfg, layer: torch.nn.Module) -> MLASelfAttention:
    if slot == "dsa_layer":
        spec = hybrid_stack_spec.submodules.dsa_layer.submodules.self_attention
        fields = {f.name: getattr(spec.submodules, f.name) for f in dataclasses.fields(spec.submodules)}
        layer_spec = ModuleSpec(module=MLASelfAttention, params=spec.params,
                                submodules=MLASelfAttentionSubmodules(**fields))
    else:
        layer_spec = standard_attention_spec()
    attention = build_module(layer_spec, config=cfg, layer_number=1)
    attention.load_state_dict(layer.self_attention.state_dict(), strict=True)
    return attention


@pytest.mark.parametrize("slot", ["dsa_layer", "mla_layer"])
def test_hybrid_latent_attention_layers_equal_the_written_out_sum(slot: str):
    cfg = dsa_config(num_layers=1) if slot == "dsa_layer" else mla_config()
    layer = _hybrid_layer(slot, cfg).train()
    expected_type = AbsorbedMLASelfAttention if slot == "dsa_layer" else MLASelfAttention
    assert type(layer.self_attention) is expected_type
    reference = _reference_attention(slot, cfg, layer).train()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 2, cfg.hidden_size, generator=gen)
    w = torch.randn(16, 2, cfg.hidden_size, generator=gen)
    results = []
    try:
        for run in ("hybrid", "reference"):
            reset_dsa_globals()
            xi = x.clone().requires_grad_(True)
            if run == "hybrid":
                out = layer(xi, None)[0]
            else:
                out = xi + reference(layer.input_layernorm(xi), None)[0]
            (out * w).sum().backward()
            results.append((out.detach(), xi.grad))
    finally:
        reset_dsa_globals()
    torch.testing.assert_close(results[0][0], results[1][0], **TOL)
    torch.testing.assert_close(results[0][1], results[1][1], **TOL)


def test_hybrid_model_with_dsa_layers_trains_a_step():
    cfg = dsa_config(num_layers=4)
    torch.manual_seed(0)
    model = HybridModel(cfg, hybrid_stack_spec, vocab_size=64, max_sequence_length=32, hybrid_layer_pattern="D-D-",
                        position_embedding_type="none")
    kinds = [type(layer.self_attention).__name__ for layer in model.decoder.layers]
    assert kinds == ["AbsorbedMLASelfAttention", "IdentityOp"] * 2  # the MLP layers have no attention
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 16), generator=gen)
    try:
        reset_dsa_globals()
        loss = model(ids, torch.arange(16).expand(2, 16), None, labels=ids)
        loss.sum().backward()
    finally:
        reset_dsa_globals()
    assert torch.isfinite(loss).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for n, p in model.named_parameters() if "indexer" not in n)


def test_hybrid_latent_layers_need_qk_layernorm():
    with pytest.raises(ValueError, match="qk_layernorm is False"):
        build_module(hybrid_stack_spec.submodules.mla_layer, config=mla_config(qk_layernorm=False), layer_number=1)
