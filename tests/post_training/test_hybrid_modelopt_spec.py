"""Model Optimizer's hybrid stack spec (``post_training.modelopt.hybrid.model_specs``) on a tiny Mamba/attention/MLP/MoE
model: the same function and checkpoint keys as the standard spec, and every linear quantized by a recipe."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization")

from megatron_core.models.hybrid import HybridModel  # noqa: E402
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec  # noqa: E402
from megatron_core.post_training.modelopt.hybrid import model_specs  # noqa: E402
from megatron_core.post_training.modelopt.mamba import model_specs as mamba_model_specs  # noqa: E402
from tests.models.mamba.mamba_test_utils import VOCAB, batch, config  # noqa: E402

PATTERN = "M*-E"
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.0)


def _model(spec, pattern: str = PATTERN) -> HybridModel:
    torch.manual_seed(3)
    main, *mtp = pattern.split("/")
    return HybridModel(config(main, **MOE, mtp_num_layers=len(mtp) or None), spec, VOCAB, 32,
                       hybrid_layer_pattern=pattern)


def _logits(model: HybridModel) -> torch.Tensor:
    ids, pos, _ = batch()
    with torch.no_grad():
        return model(ids, pos, None)


def _checkpoint_keys(model: HybridModel) -> set[str]:
    """The keys the sharded tensors are stored under (after ``sharded_state_dict_keys_map``)."""
    return {value.key for value in model.sharded_state_dict().values() if hasattr(value, "key")}


@pytest.mark.parametrize("pattern", [PATTERN, PATTERN + "/*M"])  # without and with a multi-token prediction depth
def test_modelopt_spec_builds_the_standard_model_with_its_checkpoint_keys(pattern: str):
    reference = _model(hybrid_stack_spec, pattern)
    modelopt = _model(model_specs.get_hybrid_stack_modelopt_spec(local_core_attention=True, remap_te_layernorm=True),
                      pattern)
    assert modelopt.state_dict().keys() == reference.state_dict().keys()
    assert _checkpoint_keys(modelopt) == _checkpoint_keys(reference)
    modelopt.load_state_dict(reference.state_dict())
    torch.testing.assert_close(_logits(modelopt), _logits(reference), rtol=0, atol=0)
    plain = _model(model_specs.get_hybrid_stack_modelopt_spec(local_core_attention=True))
    assert "decoder.layers.0.mixer.in_proj.layer_norm_weight" in _checkpoint_keys(reference)
    assert "decoder.layers.0.norm.weight" in _checkpoint_keys(plain)  # no remapping asked for
    assert "decoder.layers.1.input_layernorm.weight" in _checkpoint_keys(plain)


def test_default_spec_choice_and_old_path():
    assert model_specs.get_hybrid_stack_modelopt_spec(use_default_te_spec=True) is hybrid_stack_spec
    assert model_specs.get_hybrid_stack_modelopt_spec(use_default_te_spec=True, moe_grouped_gemm=False) is \
        model_specs.hybrid_stack_spec_no_moe_grouped_gemm
    assert mamba_model_specs.get_mamba_stack_modelopt_spec is model_specs.get_hybrid_stack_modelopt_spec
    no_grouped = _model(model_specs.hybrid_stack_spec_no_moe_grouped_gemm)
    assert type(no_grouped.decoder.layers[3].mlp.experts).__name__ == "SequentialMLP"


def test_fp8_recipe_quantizes_every_linear_and_keeps_logits_close():
    import modelopt.torch.quantization as mtq

    model = _model(model_specs.get_hybrid_stack_modelopt_spec(local_core_attention=True))
    reference = _logits(model)
    ids, pos, _ = batch(seed=9)
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: m(ids, pos, None))
    linears = ["decoder.layers.0.mixer.in_proj", "decoder.layers.0.mixer.out_proj",
               "decoder.layers.1.self_attention.linear_qkv", "decoder.layers.1.self_attention.linear_proj",
               "decoder.layers.2.mlp.linear_fc1", "decoder.layers.2.mlp.linear_fc2",
               "decoder.layers.3.mlp.experts.local_experts.0.linear_fc1"]
    for name in linears:
        linear = model.get_submodule(name)
        assert type(linear).__name__.startswith("Quant"), name
        assert linear.weight_quantizer.is_enabled and linear.weight_quantizer.amax is not None, name
    quantized = _logits(model)
    error = ((quantized - reference).norm() / reference.norm()).item()
    assert 1e-5 < error < 0.08, error


def test_te_state_dict_pre_hook_loads_fused_norm_names():
    from megatron_core.post_training.modelopt.gpt.state_dict_hooks import (
        mcore_gpt_load_te_state_dict_pre_hook,
    )

    reference = _model(hybrid_stack_spec)
    fused = {}
    for key, value in reference.state_dict().items():
        key = key.replace("layers.0.norm.weight", "layers.0.mixer.in_proj.layer_norm_weight")
        key = key.replace("layers.1.input_layernorm.weight", "layers.1.self_attention.linear_qkv.layer_norm_weight")
        key = key.replace("layers.2.pre_mlp_layernorm.weight", "layers.2.mlp.linear_fc1.layer_norm_weight")
        fused[key] = value
    fused["modelopt_state"] = {"anything": 1}
    model = _model(model_specs.get_hybrid_stack_modelopt_spec(local_core_attention=True))
    model._register_load_state_dict_pre_hook(mcore_gpt_load_te_state_dict_pre_hook)
    model.load_state_dict(fused)
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=0, atol=0)
