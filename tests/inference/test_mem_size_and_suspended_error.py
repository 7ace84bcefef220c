"""``contexts.dynamic_context.get_mem_size_str`` and ``engines.EngineSuspendedError`` (Megatron-Core 0.19 names)."""

from __future__ import annotations

import warnings

import pytest

from megatron_core.inference import engines
from megatron_core.inference.contexts.dynamic_context import get_mem_size_str
from megatron_core.inference.engines.dynamic_engine import EngineSuspendedError


@pytest.mark.parametrize("n_bytes, text", [
    (0, "0 bytes"),
    (1, "1 bytes"),
    (512, "512 bytes"),          # half a KB rounds down: still bytes
    (513, "0.501 KB"),
    (1024, "1 KB"),
    (1536, "1.5 KB"),
    (768 * 1024, "0.75 MB"),
    (5 * 1024**2, "5 MB"),
    (1_000_000, "0.954 MB"),
    (3 * 1024**3 // 2, "1.5 GB"),
    (2 * 1024**4, "2 TB"),
    (1500 * 1024**4, "1.5e+03 TB"),
])
def test_mem_size_str(n_bytes, text):
    assert get_mem_size_str(n_bytes) == text


def test_mem_size_str_refuses_negative_counts():
    with pytest.raises(ValueError, match="n_bytes must be >= 0, got -5"):
        get_mem_size_str(-5)


@pytest.mark.parametrize("n_bytes", [1, 7, 300, 512, 600 * 1024, 1024**2, 123_456_789, 40 * 1024**3, 3 * 1024**4])
def test_mem_size_str_matches_installed_megatron(n_bytes):
    # Megatron-Core divides by 1024**3 for "KB" (see docs/compat.md), so compare outside 0.5 KB .. 0.5 MB.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = pytest.importorskip("megatron.core.inference.contexts.dynamic_context")
    assert get_mem_size_str(n_bytes) == reference.get_mem_size_str(n_bytes)


def test_engine_suspended_error():
    assert engines.EngineSuspendedError is EngineSuspendedError
    assert issubclass(EngineSuspendedError, Exception)
    assert not issubclass(EngineSuspendedError, (RuntimeError, ValueError))
    error = EngineSuspendedError(42)
    assert error.args == (42,)
    with pytest.raises(EngineSuspendedError):
        raise error
