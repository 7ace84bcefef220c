"""Installed versions of torch and optional packages, and minimum-version checks (re-exported by ``utils``).

A package that is not installed reports version ``0.0.0`` (Transformer Engine, flash-attn, mamba-ssm,
causal-conv1d) or ``None``
(flashinfer), so ``is_*_min_version`` is simply False for it, as in Megatron-Core.
"""

from __future__ import annotations

import importlib
from importlib import metadata

import torch
from packaging.version import Version as PkgVersion

_MISSING = PkgVersion("0.0.0")
HAVE_PACKAGING = True  # Megatron-Core's flag; ``packaging`` is a dependency here (imported above)
_cache: dict[str, PkgVersion | None] = {}


def _package_version(module: str, distributions: tuple[str, ...]) -> PkgVersion | None:
    """Version of an importable ``module`` (its ``__version__``, else its distribution's); None if absent."""
    if module not in _cache:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            _cache[module] = None
            return None
        text = getattr(mod, "__version__", None)
        for dist in distributions:
            if text is not None:
                break
            try:
                text = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        _cache[module] = PkgVersion(str(text)) if text is not None else None
    return _cache[module]


def _at_least(found: PkgVersion | None, version: str, check_equality: bool) -> bool:
    if found is None:
        return False
    wanted = PkgVersion(version)
    return found >= wanted if check_equality else found > wanted


def get_torch_version() -> PkgVersion:
    """The installed torch version as a ``packaging.version.Version``."""
    return PkgVersion(torch.__version__)


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """torch >= ``version`` (> when ``check_equality`` is False)."""
    return _at_least(get_torch_version(), version, check_equality)


def get_te_version() -> PkgVersion:
    """Transformer Engine's version; ``0.0.0`` when it is not installed."""
    return _package_version("transformer_engine", ("transformer-engine", "transformer_engine")) or _MISSING


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """Transformer Engine >= ``version`` (False when it is not installed)."""
    return _at_least(get_te_version(), version, check_equality)


def get_fa_version() -> PkgVersion:
    """flash-attn's version; ``0.0.0`` when it is not installed."""
    return _package_version("flash_attn", ("flash-attn", "flash_attn")) or _MISSING


def is_fa_min_version(version: str, check_equality: bool = True) -> bool:
    """flash-attn >= ``version`` (False when it is not installed)."""
    return _at_least(get_fa_version(), version, check_equality)


def get_flashinfer_version() -> PkgVersion | None:
    """flashinfer's version, or ``None`` when it is not installed."""
    return _package_version("flashinfer", ("flashinfer", "flashinfer-python"))


def is_flashinfer_min_version(version: str, check_equality: bool = True) -> bool:
    """flashinfer >= ``version`` (False when it is not installed)."""
    return _at_least(get_flashinfer_version(), version, check_equality)


def get_mamba_version() -> PkgVersion:
    """mamba-ssm's version; ``0.0.0`` when it is not installed."""
    return _package_version("mamba_ssm", ("mamba_ssm", "mamba-ssm")) or _MISSING


def is_mamba_min_version(version: str, check_equality: bool = True) -> bool:
    """mamba-ssm >= ``version`` (False when it is not installed)."""
    return _at_least(get_mamba_version(), version, check_equality)


def get_causal_conv1d_version() -> PkgVersion:
    """causal-conv1d's version; ``0.0.0`` when it is not installed."""
    return _package_version("causal_conv1d", ("causal_conv1d", "causal-conv1d")) or _MISSING


def is_causal_conv1d_min_version(version: str, check_equality: bool = True) -> bool:
    """causal-conv1d >= ``version`` (False when it is not installed)."""
    return _at_least(get_causal_conv1d_version(), version, check_equality)
