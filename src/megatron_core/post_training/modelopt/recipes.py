"""Quantization recipes by name, and the name of the recipe a model or checkpoint was quantized with.

Megatron-LM's post-training scripts take a quantization config by the name of Model Optimizer's
predefined config (``--export-quant-cfg INT8_SMOOTHQUANT_CFG``: every name in
``modelopt.torch.quantization.config.choices``). :func:`get_quant_config` resolves such a name, refusing
an unknown one with the list of known names. :func:`recipe_of` goes the other way: it reads the config
recorded in Model Optimizer's state (``mto.modelopt_state``) and names the predefined config it equals,
so a checkpoint loaded into a model quantized otherwise can be refused naming both recipes.
"""

from __future__ import annotations

import copy
import difflib
from functools import cache
from typing import Any

from megatron_core.post_training.modelopt._backend import modelopt_modules

__all__ = ["CUSTOM_RECIPE", "get_quant_config", "known_recipes", "recipe_of"]

CUSTOM_RECIPE = "a custom quantization config"
_QUANTIZE_MODE = "quantize"


def known_recipes() -> list[str]:
    """The names of Model Optimizer's predefined quantization configs, sorted."""
    return sorted(modelopt_modules("quantization recipes").mtq.config.choices)


def get_quant_config(name: str) -> dict[str, Any]:
    """A copy of the predefined quantization config called ``name`` (e.g. ``"FP8_DEFAULT_CFG"``).

    ``ValueError`` naming the closest known names and listing all of them when ``name`` is unknown.
    """
    mtq = modelopt_modules("quantization recipes").mtq
    names = known_recipes()
    if name not in names:
        close = difflib.get_close_matches(str(name).upper(), names, n=3, cutoff=0.5)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"quantization config {name!r} is not one Model Optimizer knows{hint}; "
                         f"known configs: {', '.join(names)}")
    return copy.deepcopy(getattr(mtq, name))


@cache
def _normalised_recipes() -> tuple[tuple[str, Any], ...]:
    """``(name, (normalised quant_cfg, calibration method))`` of every predefined config."""
    mtq = modelopt_modules("quantization recipes").mtq
    out = []
    for name in known_recipes():
        cfg = getattr(mtq, name)
        try:
            normalised = mtq.config.QuantizeConfig(**cfg).model_dump()
        except Exception:  # noqa: BLE001 - a config this Model Optimizer cannot validate is never a match
            continue
        out.append((name, (repr(normalised["quant_cfg"]), _method(normalised.get("algorithm")))))
    return tuple(out)


def _method(algorithm: Any) -> str | None:
    if isinstance(algorithm, dict):
        return algorithm.get("method")
    return algorithm


def recipe_of(modelopt_state: dict[str, Any]) -> str:
    """The predefined config a model's recorded Model Optimizer state was quantized with, else :data:`CUSTOM_RECIPE`.

    ``modelopt_state`` is ``mto.modelopt_state(model)`` (or the one saved with a checkpoint); ``"none"``
    when it records no quantization.
    """
    modes = dict(modelopt_state.get("modelopt_state_dict", []))
    if _QUANTIZE_MODE not in modes:
        return "none"
    quant_cfg = repr(modes[_QUANTIZE_MODE]["config"]["quant_cfg"])
    methods = {_method(entry.get("config", {}).get("method")) for mode, entry in modes.items()
               if mode != _QUANTIZE_MODE and isinstance(entry.get("config"), dict)} - {None}
    for name, (cfg, method) in _normalised_recipes():
        if cfg == quant_cfg and (method in methods or (method is None and not methods)):
            return name
    return CUSTOM_RECIPE
