"""The default install is the fast install: numba is a core dependency and the blending builder uses it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy
import pytest
import tomllib

from megatron_core.datasets import helpers
from megatron_core.datasets.blending_jit import compiled_kernels

ROOT = Path(__file__).resolve().parents[2]


def test_numba_is_a_core_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "numba" for dep in project["dependencies"])


@pytest.mark.skipif(os.environ.get("MEGATRON_CORE_DISABLE_NUMBA", "0") not in ("", "0"), reason="numba disabled")
def test_default_path_is_compiled_and_equals_the_plain_loop(monkeypatch):
    assert compiled_kernels() is not None
    weights = numpy.array([0.5, 0.3, 0.2])
    fast = numpy.zeros(1000, dtype=numpy.int16), numpy.zeros(1000, dtype=numpy.int64)
    helpers.build_blending_indices(*fast, weights, 3, 1000)
    monkeypatch.setattr(helpers, "compiled_kernels", lambda: None)
    plain = numpy.zeros(1000, dtype=numpy.int16), numpy.zeros(1000, dtype=numpy.int64)
    helpers.build_blending_indices(*plain, weights, 3, 1000)
    assert all(numpy.array_equal(a, b) for a, b in zip(fast, plain))
    assert numpy.bincount(fast[0]).tolist() == [500, 300, 200]
