"""The distribution name is our own (``megatron-core-lite``), so NVIDIA's ``megatron-core`` installs beside it."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
from pathlib import Path

import pytest

import megatron_core
from megatron_core import package_info

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_distribution_name_differs_from_megatron_core():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["name"] == package_info.__package_name__ == "megatron-core-lite"
    assert _normalise(project["name"]) != _normalise("megatron-core")
    oracle = project["optional-dependencies"]["test-oracle"]
    assert "megatron-core==0.16.1" in oracle and set(oracle) <= set(project["optional-dependencies"]["dev"])


def test_installed_side_by_side_with_megatron_core():
    try:
        distribution = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megatron-core (the test-oracle extra) is not installed")
    if not any(str(path).startswith("megatron/core/") for path in distribution.files or []):
        pytest.skip("the installed 'megatron-core' is an old install of this project under its former name")
    assert distribution.version == "0.16.1"
    assert importlib.metadata.version("megatron-core-lite") == megatron_core.__version__
    reference = importlib.import_module("megatron.core")
    ours = Path(megatron_core.__file__).resolve().parent
    theirs = Path(reference.__file__).resolve().parent
    assert ours.name == "megatron_core" and theirs.parts[-2:] == ("megatron", "core")
    assert os.path.commonpath([ours, theirs]) not in (str(ours), str(theirs))
    # both work in one process: the same small layer from each
    from megatron.core.transformer.transformer_config import TransformerConfig as TheirConfig

    from megatron_core.transformer.transformer_config import TransformerConfig as OurConfig

    theirs_config = TheirConfig(num_layers=2, hidden_size=12, num_attention_heads=4)
    ours_config = OurConfig(num_layers=2, hidden_size=12, num_attention_heads=4)
    assert theirs_config.ffn_hidden_size == ours_config.ffn_hidden_size == 48
