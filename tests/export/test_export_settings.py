"""DataType, ModelType and ExportConfig: members, values, defaults and checks, against Megatron-Core's."""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from pathlib import Path

import pytest

from megatron_core.export.data_type import DataType
from megatron_core.export.export_config import ExportConfig
from megatron_core.export.model_type import ModelType


def _theirs(name: str):
    """Megatron-Core's ``export/<name>.py``, loaded on its own (without megatron.core's heavy package)."""
    package_dir = importlib.util.find_spec("megatron").submodule_search_locations[0]
    path = Path(package_dir) / "core" / "export" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"megatron_export_oracle_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("ours", "module", "attr"), [(DataType, "data_type", "DataType"),
                                                       (ModelType, "model_type", "ModelType")])
def test_enum_members_and_values_match_megatron(ours, module: str, attr: str) -> None:
    theirs = getattr(_theirs(module), attr)
    assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]


def test_enum_members_spelled_out() -> None:
    assert [m.name for m in DataType] == ["bfloat16", "float16", "float32"]
    assert [m.name for m in ModelType] == ["gpt", "gptnext", "llama", "falcon", "starcoder", "mixtral", "gemma",
                                           "nemotron_nas"]
    assert DataType["bfloat16"] is DataType(1) and ModelType.nemotron_nas.value == 8


def test_export_config_fields_and_defaults_match_megatron() -> None:
    theirs = _theirs("export_config").ExportConfig

    def fields(cls):
        return [(f.name, f.default) for f in dataclasses.fields(cls)]

    assert fields(ExportConfig) == fields(theirs)
    assert dataclasses.asdict(ExportConfig()) == {"inference_tp_size": 1, "inference_pp_size": 1,
                                                  "use_parallel_embedding": False, "use_embedding_sharing": None}
    config = ExportConfig(inference_tp_size=4, inference_pp_size=2, use_parallel_embedding=True)
    assert dataclasses.asdict(config) == dataclasses.asdict(theirs(4, 2, True))


def test_use_embedding_sharing_always_warns_deprecated() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")  # shown even where DeprecationWarning is filtered out
        config = ExportConfig(use_embedding_sharing=False)
        ExportConfig()
    assert config.use_embedding_sharing is False
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "use_embedding_sharing (False) is deprecated" in str(caught[0].message)
    assert "share_embeddings_and_output_weights" in str(caught[0].message)


@pytest.mark.parametrize(("field", "value"), [("inference_tp_size", 0), ("inference_pp_size", -2),
                                              ("inference_tp_size", 1.5), ("inference_pp_size", True)])
def test_sizes_must_be_positive_integers(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"ExportConfig\.{field} \({value!r}\) must be a positive integer"):
        ExportConfig(**{field: value})
