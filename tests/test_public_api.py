"""The public API is pinned: each subpackage's public names equal its checked-in list in tests/public_api/."""

from __future__ import annotations

import importlib
import warnings

import pytest

import megatron_core
from megatron_core import config
from megatron_core.utils import ExperimentalNotEnabledError, deprecated, experimental_api
from tests.public_api_lists import pinned_modules, public_names, read_list


@pytest.mark.parametrize("module_name", pinned_modules())
def test_public_surface_is_pinned(module_name):
    listed, actual = set(read_list(module_name)), set(public_names(module_name))
    assert not listed - actual, (
        f"{module_name} lost public names {sorted(listed - actual)}: a breaking change; deprecate first "
        "(docs/api_policy.md) or update tests/public_api/ on purpose"
    )
    assert not actual - listed, (
        f"{module_name} has new public names {sorted(actual - listed)}: add them with "
        "`python -m tests.public_api_lists --write " + module_name + "`"
    )


@pytest.mark.parametrize("module_name", pinned_modules())
def test_every_pinned_name_resolves(module_name):
    module = importlib.import_module(module_name)
    missing = [name for name in read_list(module_name) if not _resolves(module, name)]
    assert not missing, f"{module_name} pins names that do not resolve: {missing}"
    namespace: dict = {}
    exec(f"from {module_name} import *", namespace)  # noqa: S102 - the star-import users write
    assert set(getattr(module, "__all__", [])) <= set(namespace)


def _resolves(module, name: str) -> bool:
    try:
        getattr(module, name)
    except (AttributeError, ImportError):
        return False
    return True


def test_core_subpackages_are_pinned():
    for name in ("megatron_core", "megatron_core.parallel_state", "megatron_core.process_groups_config"):
        assert name in pinned_modules()


def test_version_is_semantic():
    major, minor, patch = megatron_core.__version__.split(".")[:3]
    assert major.isdigit() and minor.isdigit() and patch.isdigit()


def test_deprecated_warns_and_still_works():
    @deprecated("0.1", "0.3", alternative="new_fn")
    def old_fn(x):
        return x + 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert old_fn(1) == 2
    assert any("deprecated since 0.1" in str(w.message) and "new_fn" in str(w.message) for w in caught)


def test_experimental_needs_opt_in(monkeypatch):
    @experimental_api
    def shiny():
        return 42

    monkeypatch.setattr(config, "ENABLE_EXPERIMENTAL", False)
    with pytest.raises(ExperimentalNotEnabledError):
        shiny()
    monkeypatch.setattr(config, "ENABLE_EXPERIMENTAL", True)
    assert shiny() == 42
