"""The runnable snippets of docs/parallelism.md give the single-process results on CPU ranks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.dist_harness import run_on_ranks

pytestmark = pytest.mark.slow  # subprocess/torchrun training runs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "parallelism"


def _run_tensor_parallel_mlp(sequence_parallel: bool) -> float:
    spec = importlib.util.spec_from_file_location("tensor_parallel_mlp", EXAMPLES / "tensor_parallel_mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run(sequence_parallel)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_mlp_matches_nn_linear(sequence_parallel: bool) -> None:
    errors = run_on_ranks(2, _run_tensor_parallel_mlp, sequence_parallel)
    assert max(errors) < 1e-5, errors
