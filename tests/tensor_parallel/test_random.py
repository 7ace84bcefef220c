"""RNG tracker, Megatron's seed offsets, and activation recompute (``checkpoint``, ``CheckpointWithoutOutput``).

Recompute is checked against the same computation without recompute: identical outputs, input
and weight gradients, dropout masks (plain and inside ``fork()``), and RNG states afterwards.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from megatron_core import parallel_state
from megatron_core import tensor_parallel as tp
from megatron_core.tensor_parallel.random import get_all_rng_states
from tests.dist_harness import run_on_ranks

WORLD = 4


def _draw(name: str | None = None) -> torch.Tensor:
    if name is None:
        return torch.rand(4)
    with tp.get_cuda_rng_tracker().fork(name):
        return torch.rand(4)


def _seeded_draw(seed: int) -> torch.Tensor:
    return torch.rand(4, generator=torch.Generator().manual_seed(seed))


def test_tracker_add_fork_and_errors() -> None:
    tracker = tp.random.CudaRNGStatesTracker()
    tracker.add("a", 5)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(4)
    with tracker.fork("a"):
        second = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default generator"
    assert_close(torch.cat([first, second]), torch.rand(8, generator=torch.Generator().manual_seed(5)))
    with pytest.raises(ValueError, match="seed 5 already exists"):
        tracker.add("b", 5)
    with pytest.raises(ValueError, match="a already exists"):
        tracker.add("a", 6)
    with pytest.raises(KeyError, match="not added"):
        with tracker.fork("missing"):
            pass
    states = tracker.get_states()
    with tracker.fork("a"):
        third = torch.rand(4)
    tracker.set_states(states)
    with tracker.fork("a"):
        assert_close(torch.rand(4), third, rtol=0, atol=0)


def _check_seeds() -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    tp.model_parallel_cuda_manual_seed(100)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    assert_close(_draw(), _seeded_draw(100), rtol=0, atol=0)
    assert_close(_draw("data-parallel-rng"), _seeded_draw(100), rtol=0, atol=0)
    assert_close(_draw("model-parallel-rng"), _seeded_draw(100 + 2718 + tp_rank), rtol=0, atol=0)
    assert_close(_draw(tp.get_expert_parallel_rng_tracker_name()),
                 _seeded_draw(100 + 1024 + 100 * ep_rank + etp_rank), rtol=0, atol=0)
    assert tp.get_data_parallel_rng_tracker_name() == "data-parallel-rng"
    return {"tp": tp_rank, "ep": ep_rank, "etp": etp_rank}


def test_model_parallel_seed_offsets() -> None:
    ranks = run_on_ranks(WORLD, _check_seeds)
    assert {(r["tp"], r["ep"]) for r in ranks} == {(0, 0), (1, 0), (0, 1), (1, 1)}


class _Block(torch.nn.Module):
    """Linear -> dropout (default RNG) -> GELU -> dropout (model-parallel RNG) -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.fc1(x), p=0.5, training=True)
        with tp.get_cuda_rng_tracker().fork():
            h = F.dropout(F.gelu(h), p=0.5, training=True)
        return self.fc2(h)


def _run_block(block: _Block, x: torch.Tensor, mode: str, distribute: bool = False):
    """Output, grads of (x, fc1.weight, fc2.weight) and the RNG states afterwards."""
    block.zero_grad()
    x = x.clone().requires_grad_(True)
    tp.model_parallel_cuda_manual_seed(3)
    if mode == "plain":
        h = block(x)
        y = torch.tanh(h)
    elif mode == "checkpoint":
        # The input is an intermediate (as in a transformer layer), so it may be split under distribute.
        h = tp.checkpoint(block, distribute, x * 1.0)
        y = torch.tanh(h)
    else:
        ckpt = tp.CheckpointWithoutOutput()
        h = ckpt.checkpoint(block, x)
        y = torch.tanh(h)
        ckpt.discard_output_and_register_recompute(y)
        assert h.untyped_storage().size() == 0
    (y * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
    cpu_state, _, tracker_states = get_all_rng_states()
    return h.detach(), x.grad, block.fc1.weight.grad.clone(), block.fc2.weight.grad.clone(), cpu_state, tracker_states


def _compare(reference, result) -> None:
    for ref, got in zip(reference[:4], result[:4]):
        assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(reference[4], result[4]), "CPU RNG state after recompute differs"
    assert reference[5].keys() == result[5].keys()
    for name in reference[5]:
        assert torch.equal(reference[5][name], result[5][name]), f"tracker state {name} differs"


def test_checkpoint_matches_no_recompute() -> None:
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(5, 8)
    reference = _run_block(block, x, "plain")
    _compare(reference, _run_block(block, x, "checkpoint"))
    _compare(reference, _run_block(block, x, "without_output"))


def _check_distributed_checkpoint(tp_size: int) -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(4, 2, 8)
    reference = _run_block(block, x, "plain")
    _compare(reference, _run_block(block, x, "checkpoint", distribute=True))
    _compare(reference, _run_block(block, x, "without_output"))
    return {"tp_rank": parallel_state.get_tensor_model_parallel_rank(), "out": reference[0]}


def test_checkpoint_with_distributed_saved_activations() -> None:
    results = run_on_ranks(WORLD, _check_distributed_checkpoint, 2)
    by_tp = {r["tp_rank"]: r["out"] for r in results}
    # Model-parallel dropout differs across TP ranks (seed + 2718 + tp_rank).
    assert not torch.equal(by_tp[0], by_tp[1])


def test_unsupported_trackers_raise() -> None:
    with pytest.raises(ValueError, match="use_te_rng_tracker=True"):
        tp.model_parallel_cuda_manual_seed(1, te_rng_tracker=True)
    tp.model_parallel_cuda_manual_seed(1, inference_rng_tracker=True)
    before = torch.get_rng_state()
    with tp.get_cuda_rng_tracker().fork():
        pass
    assert torch.equal(before, torch.get_rng_state())
    tp.model_parallel_cuda_manual_seed(1)
    assert type(tp.get_cuda_rng_tracker()) is tp.CudaRNGStatesTracker
