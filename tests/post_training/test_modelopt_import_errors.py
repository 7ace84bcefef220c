"""Model Optimizer that cannot be imported: the error says whether it is missing or broken, and what broke it."""

from __future__ import annotations

import importlib

import pytest

from megatron_core.post_training.modelopt import _backend


def _failing_import(missing: str):
    real = importlib.import_module

    def fake(name: str, *args, **kwargs):
        if name == "modelopt" or name.startswith("modelopt."):
            raise ModuleNotFoundError(f"No module named '{missing}'", name=missing)
        return real(name, *args, **kwargs)

    return fake


def test_missing_model_optimizer_names_the_extra(monkeypatch):
    monkeypatch.setattr(_backend.importlib, "import_module", _failing_import("modelopt"))
    with pytest.raises(ImportError, match="post-training quantization needs NVIDIA Model Optimizer, which is not "
                                          "installed: pip install") as info:
        _backend.modelopt_modules()
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_model_optimizer_missing_a_dependency_names_it(monkeypatch):
    """Installed without one of its own dependencies (seen on a GPU image: ``orloge``, which pulp 4 needs)."""
    monkeypatch.setattr(_backend.importlib, "import_module", _failing_import("orloge"))
    with pytest.raises(ImportError) as info:
        _backend.modelopt_modules("knowledge distillation")
    message = str(info.value)
    assert "knowledge distillation needs NVIDIA Model Optimizer, which is installed but failed to import" in message
    assert "No module named 'orloge'" in message and "not installed" not in message
