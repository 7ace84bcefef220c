"""CudaRNGStatesTracker(use_cudagraphable_rng=True) and convert_cuda_rng_state (Megatron-Core 0.19)."""

from __future__ import annotations

import pytest
import torch

from megatron_core import tensor_parallel as tp
from megatron_core.tensor_parallel.random import CudaRNGStatesTracker, convert_cuda_rng_state


@pytest.mark.parametrize("graphable", [False, True])
def test_nested_forks_continue_each_stream(graphable):
    tracker = CudaRNGStatesTracker(use_cudagraphable_rng=graphable)
    tracker.add("a", 1234)
    tracker.add("b", 5678)
    nested_a, nested_b = [], []
    with tracker.fork("a"):
        nested_a.append(torch.randn(4))
        with tracker.fork("b"):
            nested_b.append(torch.randn(4))
            with tracker.fork("a"):
                nested_a.append(torch.randn(4))
            nested_b.append(torch.randn(4))
        nested_a.append(torch.randn(4))
    states = tracker.get_states()
    assert isinstance(states["a"], torch.Generator if graphable else torch.Tensor)
    tracker.reset()
    tracker.add("a", 1234)
    tracker.add("b", 5678)
    with tracker.fork("a"):
        flat_a = [torch.randn(4) for _ in range(3)]
    with tracker.fork("b"):
        flat_b = [torch.randn(4) for _ in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(nested_a + nested_b, flat_a + flat_b))
    tracker.set_states(states)  # generators or tensors are accepted back
    assert torch.equal(convert_cuda_rng_state(tracker.get_states()["a"]), convert_cuda_rng_state(states["a"]))


def test_convert_round_trip_and_global_tracker():
    state = torch.get_rng_state()
    generator = convert_cuda_rng_state(state, to_graphable=True)
    assert isinstance(generator, torch.Generator) and convert_cuda_rng_state(generator, to_graphable=True) is generator
    assert torch.equal(convert_cuda_rng_state(generator), state)
    with pytest.raises(ValueError, match="Invalid state type"):
        convert_cuda_rng_state(1)
    tp.model_parallel_cuda_manual_seed(7, use_cudagraphable_rng=True)
    assert tp.get_cuda_rng_tracker().use_cudagraphable_rng is True
    tp.model_parallel_cuda_manual_seed(7)
