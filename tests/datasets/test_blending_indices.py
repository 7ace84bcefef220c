"""The compiled (numba) blending loops give exactly the indices of the pure-Python loops."""

from __future__ import annotations

import numpy
import pytest

from megatron_core.datasets import blending_jit, helpers

pytest.importorskip("numba")


def _python_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(helpers, "compiled_kernels", lambda: None)


def _build(weights: list[float], size: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    dataset_index = numpy.zeros(size, dtype=numpy.int16)
    sample_index = numpy.zeros(size, dtype=numpy.int64)
    helpers.build_blending_indices(dataset_index, sample_index, weights, len(weights), size, False)
    return dataset_index, sample_index


def _build_exhaustive(sizes: list[int]) -> tuple[numpy.ndarray, numpy.ndarray]:
    total = sum(sizes)
    dataset_index = numpy.zeros(total, dtype=numpy.int16)
    sample_index = numpy.zeros(total, dtype=numpy.int64)
    helpers.build_exhaustive_blending_indices(dataset_index, sample_index, sizes, len(sizes))
    return dataset_index, sample_index


@pytest.mark.parametrize("num_datasets", [1, 3, 10])
def test_compiled_greedy_equals_python(monkeypatch, num_datasets):
    assert blending_jit.compiled_kernels() is not None
    rng = numpy.random.default_rng(num_datasets)
    weights = rng.random(num_datasets)
    weights = (weights / weights.sum()).tolist()
    if num_datasets == 3:
        weights = [0.5, 0.25, 0.25]  # exact ties between datasets 1 and 2
    compiled = _build(weights, 20_011)
    _python_only(monkeypatch)
    python = _build(weights, 20_011)
    numpy.testing.assert_array_equal(compiled[0], python[0])
    numpy.testing.assert_array_equal(compiled[1], python[1])
    counts = numpy.bincount(compiled[0], minlength=num_datasets)
    numpy.testing.assert_allclose(counts / 20_011, weights, atol=1e-3)


def test_compiled_exhaustive_equals_python(monkeypatch):
    sizes = [700, 0, 1300, 3, 2000]
    compiled = _build_exhaustive(sizes)
    _python_only(monkeypatch)
    python = _build_exhaustive(sizes)
    numpy.testing.assert_array_equal(compiled[0], python[0])
    numpy.testing.assert_array_equal(compiled[1], python[1])
    numpy.testing.assert_array_equal(numpy.bincount(compiled[0], minlength=5), sizes)


def test_disable_switch(monkeypatch):
    monkeypatch.setenv("MEGATRON_CORE_DISABLE_NUMBA", "1")
    blending_jit.compiled_kernels.cache_clear()
    try:
        assert blending_jit.compiled_kernels() is None
    finally:
        monkeypatch.delenv("MEGATRON_CORE_DISABLE_NUMBA")
        blending_jit.compiled_kernels.cache_clear()
