"""``extensions.transformer_engine.TEQuantizationParams`` / ``TEQuantizationRecipe`` (Megatron-Core 0.19's recipe entry
classes) parse a matched recipe entry with the same rules ``TransformerConfig.quant_recipe`` is checked by."""

from __future__ import annotations

import pytest

from megatron_core.enums import Fp8Recipe
from megatron_core.extensions.transformer_engine import (
    TEQuantizationParams,
    TEQuantizationRecipe,
    TransformerEngineConfigType,
)
from megatron_core.quantization.quant_config import MatchContext, QuantizationConfig


def _entry(**recipes) -> QuantizationConfig:
    config = {"transformer_engine_config_type": TransformerEngineConfigType.TEQuantizationParams.value, **recipes}
    return QuantizationConfig(config, MatchContext("decoder.layers.0.mlp.linear_fc2", 0), "bf16_fc2")


def test_parse_training_and_evaluation_recipes():
    params = TEQuantizationParams.parse_from_config(_entry(
        training_recipe={"fp8_quantization_recipe": "tensorwise", "fp8_format": "hybrid"},
        evaluation_recipe={}))
    assert params.training_recipe == TEQuantizationRecipe(fp8_quantization_recipe=Fp8Recipe.tensorwise,
                                                          fp8_format="hybrid")
    assert params.evaluation_recipe == TEQuantizationRecipe()  # high precision
    assert TEQuantizationParams.parse_from_config(_entry(training_recipe={})).evaluation_recipe is None


def test_recipe_fields_are_megatrons():
    assert TEQuantizationRecipe.get_config_keys() == {
        "fp8_quantization_recipe", "fp4_quantization_recipe", "custom_recipe_factory", "fp8_format",
        "override_quantized_autocast", "override_nonquantized_autocast", "tp_only_amax_red", "fp8_param",
        "fp4_param"}


@pytest.mark.parametrize("settings, match", [
    ({"fp8_quantization_recipe": "delayed"}, "delayed scaling"),
    ({"fp8_quantization_recipe": "tensorwise", "fp4_quantization_recipe": "nvfp4"}, "exclude each other"),
    ({"fp8_quantization_recipe": "custom"}, "custom_recipe_factory"),
    ({"fp8_margin": 1}, r"unknown fields \['fp8_margin'\]"),
    ({"fp8_quantization_recipe": "e5m2"}, "is not one of"),
])
def test_bad_recipes_are_refused_by_field(settings, match):
    with pytest.raises(ValueError, match=match):
        TEQuantizationRecipe.parse_from_config(settings)


def test_bad_entries_are_refused_by_name():
    with pytest.raises(ValueError, match="must set 'training_recipe'"):
        TEQuantizationParams.parse_from_config(_entry())
    bad = QuantizationConfig({"transformer_engine_config_type": "Other"}, MatchContext("x", None), "k")
    with pytest.raises(ValueError, match="'Other' is not supported"):
        TEQuantizationParams.parse_from_config(bad)
