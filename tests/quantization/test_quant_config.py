"""Quantization recipes (``megatron_core.quantization``): matching order, file formats, helpers, Kitchen names."""

from __future__ import annotations

import json
import sys

import pytest

from megatron_core.quantization.quant_config import (
    GlobMatcher,
    MatchContext,
    QuantizationConfig,
    RecipeConfig,
    read_recipe_file,
)
from megatron_core.quantization.utils import (
    get_quant_config_or_none,
    kitchen_quantization_recipe_config,
    load_quantization_recipe,
)
from megatron_core.transformer import TransformerConfig

RECIPE = {
    "configs": {"fc2_cfg": {"fc2": "foo"}, "fc_cfg": {"fc1": "bar"}, "default": {"default": "baz"}},
    "matchers": {
        "fc2": {"type": "glob", "pattern": "*fc2", "config": "fc2_cfg", "enabled": True},
        "off": {"type": "glob", "pattern": "*qkv", "config": "fc_cfg", "enabled": False},
        "fc": {"type": "glob", "pattern": "*fc*", "config": "fc_cfg", "enabled": True},
        "default": {"type": "glob", "pattern": "*", "config": "default", "enabled": True},
    },
}
YAML_RECIPE = """
configs:
  fc2_cfg: {fc2: foo}
  fc_cfg: {fc1: bar}
  default: {default: baz}
matchers:
  fc2: {type: glob, pattern: "*fc2", config: fc2_cfg, enabled: true}
  off: {type: glob, pattern: "*qkv", config: fc_cfg, enabled: false}
  fc: {type: glob, pattern: "*fc*", config: fc_cfg, enabled: true}
  default: {type: glob, pattern: "*", config: default, enabled: true}
"""


def _keys(recipe: RecipeConfig) -> list[str | None]:
    paths = ["decoder.layers.1.mlp.linear_fc2", "decoder.layers.1.mlp.linear_fc1", "decoder.layers.1.linear_qkv"]
    return [recipe.match_to_config_key(MatchContext(p, layer_number=1)) for p in paths]


def test_first_matching_matcher_wins():
    recipe = RecipeConfig([GlobMatcher("*fc2", "fc2_cfg"), GlobMatcher("*fc*", "fc_cfg"), GlobMatcher("*", "default")],
                          RECIPE["configs"])
    assert _keys(recipe) == ["fc2_cfg", "fc_cfg", "default"]
    assert RecipeConfig([GlobMatcher("*fc2", "fc2_cfg")], {}).match(MatchContext("x.linear_qkv", None)) is None


def test_dict_yaml_and_json_recipes_agree(tmp_path):
    yaml_path, json_path = tmp_path / "recipe.yaml", tmp_path / "recipe.json"
    yaml_path.write_text(YAML_RECIPE)
    json_path.write_text(json.dumps(RECIPE))
    expected = ["fc2_cfg", "fc_cfg", "default"]  # the disabled "*qkv" matcher is skipped
    for recipe in (RecipeConfig.from_config_dict(RECIPE), load_quantization_recipe(yaml_path),
                   RecipeConfig.from_yaml_file(json_path)):
        assert _keys(recipe) == expected
        assert [type(m) for m in recipe.matchers] == [GlobMatcher] * 3
        assert recipe.configs == RECIPE["configs"]


def test_json_needs_no_pyyaml_and_yaml_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # ``import yaml`` now raises ImportError
    json_path, yaml_path = tmp_path / "r.json", tmp_path / "r.yaml"
    json_path.write_text(json.dumps(RECIPE))
    yaml_path.write_text(YAML_RECIPE)
    assert _keys(load_quantization_recipe(json_path)) == ["fc2_cfg", "fc_cfg", "default"]
    with pytest.raises(ImportError, match="PyYAML"):
        load_quantization_recipe(yaml_path)


def test_yaml_is_read_safely(tmp_path):
    yaml = pytest.importorskip("yaml")
    marker = tmp_path / "ran"
    path = tmp_path / "evil.yaml"
    path.write_text(f"configs: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(yaml.YAMLError):
        read_recipe_file(path)
    assert not marker.exists()


@pytest.mark.parametrize("matchers,error,match", [
    ({"m": {"pattern": "*", "config": "a", "enabled": True}}, ValueError, "matcher 'm' must set 'type'"),
    ({"m": {"type": "regex", "pattern": "*", "config": "a", "enabled": True}}, NotImplementedError, "'regex'"),
    ({"m": {"type": "glob", "config": "a", "enabled": True}}, ValueError, "glob matcher 'm' must set 'pattern'"),
    ({"m": {"type": "glob", "pattern": "*", "enabled": True}}, ValueError, "glob matcher 'm' must set 'config'"),
    ({"m": "glob"}, ValueError, "matcher 'm' must be a mapping"),
])
def test_malformed_matchers_are_named(matchers, error, match):
    with pytest.raises(error, match=match):
        RecipeConfig.from_config_dict({"configs": {"a": {}}, "matchers": matchers})


def test_unknown_config_key_is_named():
    recipe = RecipeConfig([GlobMatcher("*", "missing")], {"a": {}})
    with pytest.raises(ValueError, match="'missing'.*only \\['a'\\]"):
        recipe.match(MatchContext("decoder.layers.0.mlp.linear_fc1", 0))


def test_quantization_config_is_a_private_copy():
    settings = {"nested": {"value": 1}}
    recipe = RecipeConfig([GlobMatcher("*", "a")], {"a": settings})
    first = recipe.match(MatchContext("x", None))
    first.config["nested"]["value"] = 2
    second = recipe.match(MatchContext("y", None))
    assert isinstance(second, QuantizationConfig) and second.config_key == "a"
    assert second.config == {"nested": {"value": 1}} and settings == {"nested": {"value": 1}}
    assert "config_key=a" in repr(second) and "GlobMatcher(pattern=*, config_key=a)" in repr(recipe)


def test_get_quant_config_or_none_reads_the_layer_number():
    recipe = RecipeConfig([GlobMatcher("*layers.1.*", "a")], {"a": {"k": 1}})
    matched = get_quant_config_or_none("decoder.layers.1.mlp.linear_fc1", recipe)
    assert matched.config == {"k": 1}
    assert matched.match_input == MatchContext("decoder.layers.1.mlp.linear_fc1", 1)
    assert get_quant_config_or_none("decoder.layers.0.mlp.linear_fc1", recipe) is None
    assert get_quant_config_or_none(None, recipe) is None
    assert get_quant_config_or_none("decoder.layers.1.mlp", None) is None
    catch_all = RecipeConfig([GlobMatcher("*", "a")], {"a": {}})
    assert get_quant_config_or_none("output_layer", catch_all).match_input.layer_number is None


def test_kitchen_recipe_builds_and_a_model_with_it_is_refused():
    recipe = kitchen_quantization_recipe_config(2)
    matched = get_quant_config_or_none("decoder.layers.0.self_attention.linear_qkv", recipe)
    assert matched.config == {"kitchen_config_type": "QLinearParams", "recipe_idx": 2}
    with pytest.raises(ValueError, match="NVIDIA Kitchen entry.*not available"):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, quant_recipe=recipe)
