"""Every field of Megatron-Core 0.19's ``ModelParallelConfig`` / ``TransformerConfig`` exists here.

Fields of features this library lacks are accepted at their defaults; a ``refused`` one set otherwise raises a
``ValueError`` naming it, an ``ignored`` one accepts any value (``megatron_core.megatron_only_fields``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_core import ModelParallelConfig
from megatron_core.megatron_only_fields import MegatronOnlyParallelFields, MegatronOnlyTransformerFields
from megatron_core.transformer import TransformerConfig

MEGATRON_FIELDS = [line.split() for line in (Path(__file__).parent / "data" / "megatron_core_0_19_config_fields.txt")
                   .read_text().splitlines() if line and not line.startswith("#")]
SHAPE = dict(num_layers=2, hidden_size=16, num_attention_heads=4)


def _marked(mixin: type, mark: str) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(mixin) if mark in f.metadata]


def _other_value(default):
    if isinstance(default, bool):
        return not default
    if default is None:
        return 1
    if isinstance(default, (int, float)):
        return default + 1
    return "something-else"


@pytest.mark.parametrize("owner,name", MEGATRON_FIELDS)
def test_every_megatron_config_field_exists(owner: str, name: str):
    cls = ModelParallelConfig if owner == "ModelParallelConfig" else TransformerConfig
    assert name in {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("field", _marked(MegatronOnlyTransformerFields, "refused"), ids=lambda f: f.name)
def test_refused_transformer_fields_raise_by_name_away_from_their_default(field: dataclasses.Field):
    assert getattr(TransformerConfig(**SHAPE, **{field.name: field.default}), field.name) == field.default
    with pytest.raises(ValueError, match=f"TransformerConfig: {field.name} .* must stay"):
        TransformerConfig(**SHAPE, **{field.name: _other_value(field.default)})


@pytest.mark.parametrize("field", _marked(MegatronOnlyParallelFields, "refused"), ids=lambda f: f.name)
def test_refused_parallel_fields_raise_by_name_away_from_their_default(field: dataclasses.Field):
    with pytest.raises(ValueError, match=f"ModelParallelConfig: {field.name} .* must stay"):
        ModelParallelConfig(**{field.name: _other_value(field.default)})


@pytest.mark.parametrize("field", [f for f in _marked(MegatronOnlyTransformerFields, "ignored")
                                   + _marked(MegatronOnlyParallelFields, "ignored")
                                   if f.default is not dataclasses.MISSING], ids=lambda f: f.name)
def test_ignored_fields_accept_other_values(field: dataclasses.Field):
    value = _other_value(field.default)
    assert getattr(TransformerConfig(**SHAPE, **{field.name: value}), field.name) == value
