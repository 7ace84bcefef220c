"""``MimoModelConfig``: what a MIMO model is made of.

A language-model spec, one ``ModalitySubmodules`` spec per modality, the placeholder token id of each
modality, and optionally one ``HyperCommGrid`` per module (which ranks run which module).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_core.transformer.spec_utils import ModuleSpec

_KV_FORMATS = ("sbhd", "thd")


def _empty_spec() -> ModuleSpec:
    return ModuleSpec(module=None)


@dataclass
class MimoModelConfig:
    """Configuration of a ``MimoModel``.

    ``language_model_spec`` builds the language model (its ``params['config']`` is the model's
    ``TransformerConfig``); ``modality_submodules_spec`` maps a modality name to the spec of its
    ``ModalitySubmodules``; ``special_token_ids`` maps a modality name to the token id that marks, in
    ``input_ids``, each position where one of that modality's embeddings goes. ``module_to_grid_map``
    (optional) maps every modality name and ``MIMO_LANGUAGE_MODULE_KEY`` to a ``HyperCommGrid``: grids
    on the same ranks make a colocated layout, grids on disjoint ranks a non-colocated one.
    ``kv_format`` is the attention layout, ``"sbhd"`` or ``"thd"`` (packed).
    """

    language_model_spec: ModuleSpec = field(default_factory=_empty_spec)
    modality_submodules_spec: dict[str, ModuleSpec] = field(default_factory=dict)
    special_token_ids: dict[str, int] = field(default_factory=dict)
    module_to_grid_map: dict[str, Any] | None = None
    kv_format: str = "sbhd"

    def __post_init__(self) -> None:
        if self.kv_format not in _KV_FORMATS:
            raise ValueError(f"MimoModelConfig.kv_format must be one of {_KV_FORMATS}, got {self.kv_format!r}")
        if not self.module_to_grid_map:
            return
        from megatron_core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY

        expected = set(self.modality_submodules_spec) | {MIMO_LANGUAGE_MODULE_KEY}
        given = set(self.module_to_grid_map)
        if given != expected:
            raise ValueError(
                f"MimoModelConfig.module_to_grid_map keys must be the modality names plus "
                f"'{MIMO_LANGUAGE_MODULE_KEY}': missing {sorted(expected - given)}, extra {sorted(given - expected)}")

__all__ = ["MimoModelConfig"]
