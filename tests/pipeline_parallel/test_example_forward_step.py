"""``examples/gpt_pipeline_forward_step.py`` trains under PP=2 x DP=2 (1F1B and interleaved) on CPU ranks."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from megatron_core import parallel_state
from tests.dist_harness import run_on_ranks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt_pipeline_forward_step.py"


def _train(vpp):
    spec = importlib.util.spec_from_file_location("gpt_pipeline_forward_step", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    history = module.train(pp=2, vpp=vpp, num_microbatches=4, iterations=4)
    return history, parallel_state.is_pipeline_last_stage()


@pytest.mark.parametrize("vpp", [None, 2])
def test_example_trains_under_pipeline_parallelism(vpp):
    for history, is_last in run_on_ranks(4, _train, vpp):
        if not is_last:
            assert history == []
            continue
        assert len(history) == 4 and all(math.isfinite(x) for x in history)
        assert history[-1] < history[0] - 0.05, history
