"""Helpers around quantization recipes (Megatron-Core's ``megatron.core.quantization.utils``).

:func:`get_quant_config_or_none` resolves the settings of one module by its path; :func:`load_quantization_recipe`
reads a recipe file (Megatron-LM's ``--te-precision-config-file`` / ``--kitchen-config-file``);
:func:`kitchen_quantization_recipe_config` builds the one-entry recipe of Megatron-LM's ``--kitchen-recipe-number``.
NVIDIA Kitchen is not available here: the kitchen recipe builds as in Megatron-Core, and a model configured with it
is refused when its ``TransformerConfig`` is validated (:mod:`megatron_core.quantization.layer_precision`).
"""

from __future__ import annotations

import re
from pathlib import Path

from megatron_core.quantization.quant_config import (
    GlobMatcher,
    MatchContext,
    QuantizationConfig,
    RecipeConfig,
)

__all__ = ["get_quant_config_or_none", "kitchen_quantization_recipe_config", "load_quantization_recipe"]

_LAYER_INDEX = re.compile(r"layers\.(\d+)")


def get_quant_config_or_none(module_path: str | None, recipe: RecipeConfig | None = None
                             ) -> QuantizationConfig | None:
    """The settings ``recipe`` selects for the module at ``module_path`` (its layer number read from the first
    ``layers.<n>`` in the path), or None without a recipe, a path or a matching matcher."""
    if recipe is None or module_path is None:
        return None
    found = _LAYER_INDEX.search(module_path)
    layer_number = int(found.group(1)) if found else None
    return recipe.match(MatchContext(module_path=module_path, layer_number=layer_number))


def load_quantization_recipe(recipe_path: str | Path) -> RecipeConfig:
    """The recipe in the YAML (or ``.json``) file at ``recipe_path``."""
    return RecipeConfig.from_yaml_file(recipe_path)


def kitchen_quantization_recipe_config(recipe_idx: int) -> RecipeConfig:
    """A recipe giving every module NVIDIA Kitchen's predefined ``QLinearParams`` recipe number ``recipe_idx``."""
    return RecipeConfig(
        matchers=[GlobMatcher(pattern="*", config_key="default")],
        config_dict={"default": {"kitchen_config_type": "QLinearParams", "recipe_idx": recipe_idx}},
    )
