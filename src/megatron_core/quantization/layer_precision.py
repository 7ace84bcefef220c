"""What a quantization recipe (``TransformerConfig.quant_recipe``) means for this library's FP8 layers.

Megatron-Core 0.19 applies a matched recipe entry inside each Transformer Engine linear layer: an entry of type
``transformer_engine_config_type: TEQuantizationParams`` holds a ``training_recipe`` (and optionally an
``evaluation_recipe``) whose fields (``fp8_quantization_recipe``, ``fp4_quantization_recipe``, ``fp8_format``,
``override_quantized_autocast``, ``override_nonquantized_autocast``, ``tp_only_amax_red``, ``fp8_param``,
``fp4_param``, ``custom_recipe_factory``) open that layer's own autocast. This library chooses each layer's GEMM
when :func:`megatron_core.fp8.convert_to_float8` converts the model, so it honours the part of a recipe that is a
per-layer choice between FP8 and high precision:

* an entry with neither an FP8 nor an FP4 recipe keeps the matched layers in high precision (bf16) in an FP8
  model (``override_quantized_autocast``, default True; False leaves them to the model's setting);
* an entry whose FP8 settings equal the model's (``fp8_quantization_recipe == fp8_recipe``, ``fp8_format == fp8``,
  ``tp_only_amax_red``, ``fp8_param``) runs them in FP8, as without the entry;
* in a model without ``fp8`` an FP8 entry changes nothing, as in Megatron-Core (``override_nonquantized_autocast``
  is False by default).

Everything else raises ``ValueError`` naming the entry and the field when the ``TransformerConfig`` is validated
(:func:`check_quant_recipe`): FP4, custom recipes, FP8 recipes or settings other than the model's,
``override_nonquantized_autocast=True`` with an FP8 recipe, an ``evaluation_recipe`` differing from the training
one, and NVIDIA Kitchen entries (``kitchen_config_type``), whose library is not available here.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from megatron_core.enums import Fp4Recipe, Fp8Recipe
from megatron_core.quantization.quant_config import RecipeConfig, recipe_config_keys
from megatron_core.quantization.utils import get_quant_config_or_none

__all__ = ["LayerRecipe", "TEQuantizationParams", "TE_CONFIG_TYPE_KEY", "TransformerEngineConfigType",
           "check_quant_recipe", "fp8_override_for_module", "parse_te_quantization_params"]

TE_CONFIG_TYPE_KEY = "transformer_engine_config_type"
_TE_PARAMS_TYPE = "TEQuantizationParams"  # TransformerEngineConfigType.TEQuantizationParams.value
_KITCHEN_CONFIG_TYPE_KEY = "kitchen_config_type"
_RECIPE_KEYS = ("training_recipe", "evaluation_recipe")


class TransformerEngineConfigType(enum.Enum):
    """The kinds of recipe entry (the value of ``transformer_engine_config_type``), as Megatron-Core's enum."""

    TEQuantizationParams = "TEQuantizationParams"


@dataclass(frozen=True)
class LayerRecipe:
    """One ``training_recipe`` / ``evaluation_recipe`` of a ``TEQuantizationParams`` entry: Megatron-Core 0.19's
    ``TEQuantizationRecipe`` (its fields and defaults; re-exported under that name by
    ``extensions.transformer_engine``)."""

    fp8_quantization_recipe: Fp8Recipe | None = None
    fp4_quantization_recipe: Fp4Recipe | None = None
    custom_recipe_factory: str | None = None
    fp8_format: str = "e4m3"
    override_quantized_autocast: bool = True
    override_nonquantized_autocast: bool = False
    tp_only_amax_red: bool = False
    fp8_param: bool = False
    fp4_param: bool = False


    @classmethod
    def parse_from_config(cls, quant_config: dict[str, Any]) -> LayerRecipe:
        """The recipe of one ``training_recipe`` / ``evaluation_recipe`` mapping; ``ValueError`` naming the field
        when it is malformed (unknown field, delayed scaling, FP8 with FP4, custom without a factory)."""
        return _parse_layer_recipe(quant_config, "recipe")

    @classmethod
    def get_config_keys(cls) -> set[str]:
        """The recipe's field names."""
        return set(_LAYER_RECIPE_FIELDS)


_LAYER_RECIPE_FIELDS = tuple(f.name for f in dataclasses.fields(LayerRecipe))


@dataclass(frozen=True)
class TEQuantizationParams:
    """A ``TEQuantizationParams`` recipe entry: the layer's ``training_recipe`` and (None: the same)
    ``evaluation_recipe`` (Megatron-Core 0.19's class; re-exported by ``extensions.transformer_engine``)."""

    training_recipe: LayerRecipe
    evaluation_recipe: LayerRecipe | None

    @staticmethod
    def parse_from_config(quant_config: Any) -> TEQuantizationParams:
        """The entry a matched ``QuantizationConfig`` holds; ``ValueError`` naming the entry and field."""
        training, evaluation = parse_te_quantization_params(quant_config.config, quant_config.config_key)
        return TEQuantizationParams(training_recipe=training, evaluation_recipe=evaluation)


def _parse_layer_recipe(settings: Any, where: str) -> LayerRecipe:
    if not isinstance(settings, dict):
        raise ValueError(f"{where} must be a mapping of {list(_LAYER_RECIPE_FIELDS)}; got {settings!r}")
    unknown = sorted(set(settings) - set(_LAYER_RECIPE_FIELDS))
    if unknown:
        raise ValueError(f"{where} has unknown fields {unknown}; known: {list(_LAYER_RECIPE_FIELDS)}")
    values = dict(settings)
    for name, choices in (("fp8_quantization_recipe", Fp8Recipe), ("fp4_quantization_recipe", Fp4Recipe)):
        if values.get(name) is not None:
            try:
                values[name] = choices(values[name])
            except ValueError:
                raise ValueError(f"{where}.{name}={values[name]!r} is not one of "
                                 f"{[member.value for member in choices]}") from None
    recipe = LayerRecipe(**values)
    if recipe.fp8_quantization_recipe == Fp8Recipe.delayed:
        raise ValueError(f"{where}.fp8_quantization_recipe='delayed': delayed scaling cannot be set per module "
                         "(Megatron-Core's rule)")
    if recipe.fp8_quantization_recipe is not None and recipe.fp4_quantization_recipe is not None:
        raise ValueError(f"{where} sets both fp8_quantization_recipe and fp4_quantization_recipe; they exclude "
                         "each other")
    custom = Fp8Recipe.custom == recipe.fp8_quantization_recipe or Fp4Recipe.custom == recipe.fp4_quantization_recipe
    if custom and recipe.custom_recipe_factory is None:
        raise ValueError(f"{where}: a 'custom' recipe needs custom_recipe_factory")
    return recipe


def parse_te_quantization_params(settings: dict, key: str) -> tuple[LayerRecipe, LayerRecipe | None]:
    """``(training_recipe, evaluation_recipe or None)`` of the recipe entry ``key`` (a ``TEQuantizationParams``
    mapping); ``ValueError`` naming the entry and field when it is malformed."""
    where = f"quant_recipe config {key!r}"
    if not isinstance(settings, dict):
        raise ValueError(f"{where} must be a mapping; got {settings!r}")
    if _KITCHEN_CONFIG_TYPE_KEY in settings:
        raise ValueError(f"{where} is an NVIDIA Kitchen entry ({_KITCHEN_CONFIG_TYPE_KEY}="
                         f"{settings[_KITCHEN_CONFIG_TYPE_KEY]!r}); Kitchen is not available in this library")
    if TE_CONFIG_TYPE_KEY not in settings:
        raise ValueError(f"{where} must set {TE_CONFIG_TYPE_KEY!r} (to {_TE_PARAMS_TYPE!r})")
    if settings[TE_CONFIG_TYPE_KEY] != _TE_PARAMS_TYPE:
        raise ValueError(f"{where}: {TE_CONFIG_TYPE_KEY}={settings[TE_CONFIG_TYPE_KEY]!r} is not supported; "
                         f"expected {_TE_PARAMS_TYPE!r}")
    unknown = sorted(set(settings) - {TE_CONFIG_TYPE_KEY, *_RECIPE_KEYS})
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; expected {TE_CONFIG_TYPE_KEY!r}, "
                         f"'training_recipe' and optionally 'evaluation_recipe'")
    if "training_recipe" not in settings:
        raise ValueError(f"{where} must set 'training_recipe'")
    training = _parse_layer_recipe(settings["training_recipe"], f"{where}.training_recipe")
    evaluation = None
    if "evaluation_recipe" in settings:
        evaluation = _parse_layer_recipe(settings["evaluation_recipe"], f"{where}.evaluation_recipe")
    return training, evaluation


def _model_fp8_settings(cfg: Any) -> dict[str, Any]:
    return {"fp8_quantization_recipe": cfg.fp8_recipe, "fp8_format": cfg.fp8,
            "tp_only_amax_red": bool(getattr(cfg, "tp_only_amax_red", False)),
            "fp8_param": bool(getattr(cfg, "fp8_param", False))}


def _override(cfg: Any, key: str, settings: dict) -> bool | None:
    """True (FP8), False (high precision) or None (the model's own choice) for modules matching entry ``key``."""
    where = f"quant_recipe config {key!r}"
    training, evaluation = parse_te_quantization_params(settings, key)
    if evaluation is not None and evaluation != training:
        raise ValueError(f"{where}: an evaluation_recipe different from the training_recipe is not supported (this "
                         "library chooses each layer's GEMM when the model is converted, not per mode)")
    if training.fp4_quantization_recipe is not None or training.fp4_param:
        raise ValueError(f"{where}.training_recipe asks for FP4 (fp4_quantization_recipe="
                         f"{training.fp4_quantization_recipe}, fp4_param={training.fp4_param}); FP4 training is not "
                         "available in this library")
    if training.custom_recipe_factory is not None:
        raise ValueError(f"{where}.training_recipe.custom_recipe_factory={training.custom_recipe_factory!r}: custom "
                         "recipes need Transformer Engine")
    if training.fp8_quantization_recipe is None:
        return False if cfg.fp8 is not None and training.override_quantized_autocast else None
    if training.override_nonquantized_autocast:
        raise ValueError(f"{where}.training_recipe.override_nonquantized_autocast=True (FP8 in layers the model "
                         "runs in high precision) is not supported; set TransformerConfig.fp8 instead")
    if cfg.fp8 is None:
        if training.fp8_param:
            raise ValueError(f"{where}.training_recipe.fp8_param=True needs TransformerConfig.fp8 and fp8_param")
        return None
    if not training.override_quantized_autocast:
        return None
    wanted = {"fp8_quantization_recipe": training.fp8_quantization_recipe.value, "fp8_format": training.fp8_format,
              "tp_only_amax_red": training.tp_only_amax_red, "fp8_param": training.fp8_param}
    model = _model_fp8_settings(cfg)
    differing = {name: value for name, value in wanted.items() if value != model[name]}
    if differing:
        raise ValueError(f"{where}.training_recipe sets {differing}, but the model's FP8 settings are "
                         f"{ {name: model[name] for name in differing} } (fp8_recipe, fp8, tp_only_amax_red, "
                         "fp8_param); per-module FP8 settings other than the model's are not supported: a recipe "
                         "entry may only keep layers in high precision or leave them to the model")
    return True


def check_quant_recipe(cfg: Any) -> None:
    """``ValueError`` unless ``cfg.quant_recipe`` is None or a :class:`RecipeConfig` every entry of which its
    matchers can select this library honours (module docstring), given ``cfg``'s FP8 settings."""
    recipe = getattr(cfg, "quant_recipe", None)
    if recipe is None:
        return
    if not isinstance(recipe, RecipeConfig):
        raise ValueError(f"quant_recipe must be a megatron_core.quantization.quant_config.RecipeConfig or None; got "
                         f"{type(recipe).__name__} (load one with quantization.utils.load_quantization_recipe)")
    for key in recipe_config_keys(recipe):
        if key not in recipe.configs:
            raise ValueError(f"quant_recipe: a matcher selects config {key!r}, but configs has only "
                             f"{sorted(recipe.configs)}")
        _override(cfg, key, recipe.configs[key])


def fp8_override_for_module(cfg: Any, module_path: str) -> bool | None:
    """For the module at ``module_path`` (its name in the model, e.g. ``decoder.layers.0.mlp.linear_fc2``): True
    when ``cfg.quant_recipe`` runs it in FP8, False when it keeps it in high precision, None when no entry matches
    or the matched entry leaves it to the model's setting."""
    matched = get_quant_config_or_none(module_path, getattr(cfg, "quant_recipe", None))
    if matched is None:
        return None
    return _override(cfg, matched.config_key, matched.config)
