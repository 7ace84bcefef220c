"""``TransformerConfig.quant_recipe`` on this library's FP8 layers: entries keeping layers in high precision are
honoured by ``convert_to_float8``; everything else is refused by name when the config is validated."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.fp8 import convert_to_float8
from megatron_core.quantization.layer_precision import fp8_override_for_module
from megatron_core.quantization.quant_config import RecipeConfig
from megatron_core.tensor_parallel.layers import RowParallelLinear
from megatron_core.transformer import TransformerConfig
from tests.models.gpt_test_utils import build, llama_like

BF16 = {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": {}}


def _recipe(settings: dict, pattern: str = "*linear_fc2") -> RecipeConfig:
    return RecipeConfig.from_config_dict({
        "configs": {"entry": settings},
        "matchers": {"m": {"type": "glob", "pattern": pattern, "config": "entry", "enabled": True}},
    })


def _te(**training) -> dict:
    return {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": training}


def _config(**overrides) -> TransformerConfig:
    return TransformerConfig(**{**llama_like()["config"], "fp8": "e4m3", "fp8_recipe": "delayed", **overrides})


def _models(recipe: RecipeConfig):
    spec = llama_like(fp8="e4m3", fp8_recipe="delayed")
    torch.manual_seed(0)
    plain = build(spec)
    torch.manual_seed(0)
    with_recipe = build(spec, quant_recipe=recipe)
    return plain, with_recipe


def test_recipe_keeps_matched_layers_in_high_precision():
    plain, mixed = _models(_recipe(BF16))
    converted_plain = convert_to_float8(plain, emulate=True)
    converted_mixed = convert_to_float8(mixed, emulate=True)
    fc2 = [name for name in converted_plain if name.endswith("linear_fc2")]
    assert len(fc2) == 2 and sorted(converted_mixed) == sorted(set(converted_plain) - set(fc2))
    x = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(1))
    h = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(2))
    for plain_layer, mixed_layer in zip(plain.decoder.layers, mixed.decoder.layers):
        fc2_mixed = mixed_layer.mlp.linear_fc2
        assert type(fc2_mixed) is RowParallelLinear
        reference = F.linear(x, fc2_mixed.weight)
        torch.testing.assert_close(fc2_mixed(x)[0], reference, rtol=1e-5, atol=1e-5)
        assert (plain_layer.mlp.linear_fc2(x)[0] - reference).abs().max() > 1e-3  # FP8 rounding where not kept
        torch.testing.assert_close(mixed_layer.mlp.linear_fc1(h)[0], plain_layer.mlp.linear_fc1(h)[0], rtol=0, atol=0)


def test_entries_matching_the_model_or_deferring_to_it_change_nothing():
    same = _te(fp8_quantization_recipe="tensorwise", fp8_format="e4m3")
    cfg = _config(fp8_recipe="tensorwise", quant_recipe=_recipe(same))
    assert fp8_override_for_module(cfg, "decoder.layers.0.mlp.linear_fc2") is True
    assert fp8_override_for_module(cfg, "decoder.layers.0.mlp.linear_fc1") is None
    deferring = _config(quant_recipe=_recipe(_te(override_quantized_autocast=False)))
    assert fp8_override_for_module(deferring, "decoder.layers.0.mlp.linear_fc2") is None
    bf16_model = TransformerConfig(**llama_like()["config"], quant_recipe=_recipe(_te(fp8_quantization_recipe="tensorwise")))
    assert fp8_override_for_module(bf16_model, "decoder.layers.1.mlp.linear_fc2") is None  # stays bf16, as 0.19
    assert fp8_override_for_module(_config(quant_recipe=_recipe(BF16)), "decoder.layers.1.mlp.linear_fc2") is False


@pytest.mark.parametrize("settings,match", [
    (_te(fp4_quantization_recipe="nvfp4"), "FP4"),
    (_te(fp8_quantization_recipe="mxfp8"), r"fp8_quantization_recipe.*mxfp8"),
    (_te(fp8_quantization_recipe="tensorwise"), r"'fp8_quantization_recipe': 'tensorwise'.*'delayed'"),
    (_te(fp8_quantization_recipe="delayed"), "delayed scaling cannot be set per module"),
    (_te(fp8_quantization_recipe="custom"), "custom_recipe_factory"),
    (_te(fp8_quantization_recipe="custom", custom_recipe_factory="pkg.f"), "custom recipes need Transformer Engine"),
    (_te(fp8_quantization_recipe="tensorwise", fp8_quantization_recipe_x=1), r"unknown fields \['fp8_quantization_recipe_x'\]"),
    (_te(fp8_quantization_recipe="tensorwise", override_nonquantized_autocast=True), "override_nonquantized_autocast"),
    (_te(fp8_quantization_recipe="blockwise", fp4_quantization_recipe="nvfp4"), "exclude each other"),
    ({**BF16, "evaluation_recipe": {"fp8_quantization_recipe": "tensorwise"}}, "evaluation_recipe different"),
    ({"training_recipe": {}}, "must set 'transformer_engine_config_type'"),
    ({"transformer_engine_config_type": "Other", "training_recipe": {}}, "'Other' is not supported"),
    ({"transformer_engine_config_type": "TEQuantizationParams"}, "must set 'training_recipe'"),
    ({**BF16, "extra": 1}, r"unknown keys \['extra'\]"),
])
def test_unsupported_entries_are_refused_by_name(settings, match):
    with pytest.raises(ValueError, match=match):
        _config(quant_recipe=_recipe(settings))


def test_recipe_type_and_missing_configs_are_refused():
    with pytest.raises(ValueError, match="quant_recipe must be a .*RecipeConfig or None; got dict"):
        _config(quant_recipe={"configs": {}})
    broken = RecipeConfig.from_config_dict({"configs": {}, "matchers": {
        "m": {"type": "glob", "pattern": "*", "config": "nowhere", "enabled": True}}})
    with pytest.raises(ValueError, match="selects config 'nowhere'"):
        _config(quant_recipe=broken)
    same_eval = {**BF16, "evaluation_recipe": {}}
    assert _config(quant_recipe=_recipe(same_eval)).quant_recipe is not None
