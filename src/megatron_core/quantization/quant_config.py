"""Per-module quantization recipes (Megatron-Core's ``megatron.core.quantization.quant_config``).

A recipe has two parts:

* ``configs``: named settings dictionaries, each saying *how* an operator is quantized; the layers that accept
  per-module quantization read them (here: :mod:`megatron_core.quantization.layer_precision`, for this library's
  FP8 layers);
* ``matchers``: an ordered list that says *which* settings apply to an operator. Matchers are tried in order on the
  operator's :class:`MatchContext` (its module path, e.g. ``decoder.layers.3.mlp.linear_fc1``); the first that
  matches names the settings, so a catch-all ``"*"`` last gives a default. ``"glob"`` (shell-style patterns,
  :class:`GlobMatcher`) is the one matcher type; others subclass :class:`Matcher`.

Recipes are written as YAML, as in Megatron-Core::

    configs:
      bf16: {transformer_engine_config_type: TEQuantizationParams, training_recipe: {}}
    matchers:
      keep_fc2_bf16: {type: glob, pattern: "*linear_fc2", config: bf16, enabled: true}

or as JSON of the same structure, or built from a dictionary (:meth:`RecipeConfig.from_config_dict`). PyYAML is an
optional dependency, imported only when a YAML file is read (:func:`read_recipe_file`); files are read with
``yaml.safe_load``. A malformed recipe raises ``ValueError`` naming the matcher and field (Megatron-Core asserts);
an unknown matcher type raises ``NotImplementedError``, as in Megatron-Core.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import logging
from abc import ABC, abstractmethod
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["GlobMatcher", "MatchContext", "Matcher", "QuantizationConfig", "RecipeConfig", "logger",
           "read_recipe_file", "recipe_config_keys"]

logger = logging.getLogger(__name__)

_JSON_SUFFIXES = (".json",)


@dataclass
class MatchContext:
    """What a matcher sees of an operator: its module path in the model and its layer number (or None)."""

    module_path: str
    layer_number: int | None


class QuantizationConfig:
    """The settings one operator matched: a private copy of the recipe's dictionary, the context and its key.

    The dictionary is deep-copied so that a module editing its settings cannot change another module's.
    """

    def __init__(self, config: dict, match_input: MatchContext, config_key: str) -> None:
        self.config = deepcopy(config)
        self.match_input = match_input
        self.config_key = config_key

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(config={self.config}, match_input={self.match_input}, "
                f"config_key={self.config_key})")


class Matcher(ABC):
    """Selects operators: :meth:`match` returns the settings key for a matching context, else None."""

    @abstractmethod
    def match(self, context: MatchContext) -> str | None:
        """The configuration key for ``context``, or None when this matcher does not select it."""


class GlobMatcher(Matcher):
    """Matches the module path against a shell-style pattern (``fnmatch``): ``"*fc2*"`` anywhere,
    ``"*fc2"`` at the end, ``"*layers.10.*"`` one layer."""

    def __init__(self, pattern: str, config_key: str) -> None:
        self.pattern = pattern
        self.config_key = config_key

    def match(self, context: MatchContext) -> str | None:
        """``config_key`` when the module path matches ``pattern``, else None."""
        return self.config_key if fnmatch.fnmatch(context.module_path, self.pattern) else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pattern={self.pattern}, config_key={self.config_key})"


def _log(message: str) -> None:
    """``logger.info`` on global rank 0 only (every rank when ``torch.distributed`` is not initialised)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized() \
            or torch.distributed.get_rank() == 0:
        logger.info(message)


def _glob_matcher(name: str, spec: dict) -> GlobMatcher:
    for field in ("pattern", "config"):
        if spec.get(field) is None:
            raise ValueError(f"quantization recipe: glob matcher {name!r} must set {field!r}; got {spec}")
    return GlobMatcher(spec["pattern"], spec["config"])


_MATCHER_TYPES = {"glob": _glob_matcher}


def read_recipe_file(path: str | Path) -> dict:
    """The recipe dictionary in file ``path``: JSON for a ``.json`` file, else YAML (``yaml.safe_load``; needs
    PyYAML, ``ImportError`` naming it otherwise)."""
    path = Path(path)
    text = path.read_text()
    if path.suffix.lower() in _JSON_SUFFIXES:
        data = json.loads(text)
    else:
        try:
            yaml = importlib.import_module("yaml")
        except ImportError as error:
            raise ImportError(f"reading the YAML quantization recipe {str(path)!r} needs PyYAML "
                              "(pip install pyyaml); a .json recipe of the same structure needs nothing") from error
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"quantization recipe {str(path)!r} must hold a mapping with 'configs' and 'matchers'; "
                         f"got {type(data).__name__}")
    return data


class RecipeConfig:
    """A quantization recipe: ordered ``matchers`` and the ``configs`` dictionary they name."""

    def __init__(self, matchers: list[Matcher], config_dict: dict[str, dict]) -> None:
        self.configs = config_dict
        self.matchers = matchers

    @staticmethod
    def _build_matchers(matchers_dict: dict | None) -> list[Matcher]:
        """The enabled matchers of ``matchers_dict`` in their written order (the order sets precedence)."""
        if matchers_dict is None:
            return []
        if not isinstance(matchers_dict, dict):
            raise ValueError(f"quantization recipe: 'matchers' must be a mapping of name -> matcher; got "
                             f"{type(matchers_dict).__name__}")
        matchers: list[Matcher] = []
        for name, spec in matchers_dict.items():
            if not isinstance(spec, dict):
                raise ValueError(f"quantization recipe: matcher {name!r} must be a mapping; got {spec!r}")
            if not spec.get("enabled", False):
                continue
            match_type = spec.get("type")
            if match_type is None:
                raise ValueError(f"quantization recipe: matcher {name!r} must set 'type' (one of "
                                 f"{sorted(_MATCHER_TYPES)})")
            if match_type not in _MATCHER_TYPES:
                raise NotImplementedError(f"quantization recipe: matcher {name!r} has type {match_type!r}; "
                                          f"implemented: {sorted(_MATCHER_TYPES)}")
            matchers.append(_MATCHER_TYPES[match_type](name, spec))
        return matchers

    @staticmethod
    def from_yaml_file(recipe_yaml_path: str | Path) -> RecipeConfig:
        """The recipe in a YAML file (or a JSON one, by its ``.json`` suffix; :func:`read_recipe_file`)."""
        config = read_recipe_file(recipe_yaml_path)
        _log(f"Loaded quantization recipe from path '{recipe_yaml_path}'. Contents: '{config}'")
        return RecipeConfig.from_config_dict(config)

    @staticmethod
    def from_config_dict(config: dict) -> RecipeConfig:
        """The recipe of a dictionary with ``matchers`` (optional) and ``configs`` (default empty)."""
        if not isinstance(config, dict):
            raise ValueError(f"quantization recipe must be a mapping; got {type(config).__name__}")
        matchers = RecipeConfig._build_matchers(config.get("matchers"))
        return RecipeConfig(matchers, config.get("configs") or {})

    def match_to_config_key(self, operator_context: MatchContext) -> str | None:
        """The key named by the first matcher that selects ``operator_context``, or None."""
        for matcher in self.matchers:
            config_key = matcher.match(operator_context)
            if config_key is not None:
                _log(f'Context ({operator_context}) matched to quant config "{config_key}"')
                return config_key
        _log(f"No config key match found for Context ({operator_context})")
        return None

    def match(self, operator_context: MatchContext) -> QuantizationConfig | None:
        """The :class:`QuantizationConfig` selected for ``operator_context``, or None; ``ValueError`` when a
        matcher names a key missing from ``configs``."""
        config_key = self.match_to_config_key(operator_context)
        if config_key is None:
            return None
        if config_key not in self.configs:
            raise ValueError(f"quantization recipe: a matcher selects config {config_key!r} for "
                             f"{operator_context.module_path!r}, but configs has only {sorted(self.configs)}")
        return QuantizationConfig(self.configs[config_key], match_input=operator_context, config_key=config_key)

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}("] + [f"  matcher({matcher!r}" for matcher in self.matchers] + [")"]
        return "\n".join(lines)


def recipe_config_keys(recipe: RecipeConfig) -> list[str]:
    """The configuration keys the recipe's matchers can select, in matcher order (glob matchers' keys)."""
    keys: list[str] = []
    for matcher in recipe.matchers:
        key: Any = getattr(matcher, "config_key", None)
        if key is not None and key not in keys:
            keys.append(key)
    return keys
