"""vocab_parallel_cross_entropy against F.cross_entropy on the gathered logits (loss and logit gradients).

TP in {1, 2, 4} on 4 CPU ranks, label smoothing 0 and 0.1, fp32, plus large logits for stability
and bf16 input logits (computed in fp32, gradient returned in bf16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from megatron_core import parallel_state
from megatron_core import tensor_parallel as tp
from tests.dist_harness import run_on_ranks

WORLD = 4
S, B, V = 6, 3, 32


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _reference(logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, smoothing: float):
    logits = logits.clone().requires_grad_(True)
    loss = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction="none",
                           label_smoothing=smoothing).reshape(target.shape)
    (loss * weights).sum().backward()
    return loss.detach(), logits.grad


def _check_cross_entropy(tp_size: int, fused: bool = False) -> None:
    """``vocab_parallel_cross_entropy`` (or, ``fused``, the native kernel of ``cross_entropy_loss_fusion``)."""
    from megatron_core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    def cross_entropy(local, target, smoothing=0.0):
        if fused:
            return fused_vocab_parallel_cross_entropy(local, target)
        return tp.vocab_parallel_cross_entropy(local, target, label_smoothing=smoothing)

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    rank = parallel_state.get_tensor_model_parallel_rank()
    target = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(1))
    weights = _rand(S, B, seed=2)
    cases = [(1.0, 0.0), (60.0, 0.0)] if fused else [(1.0, 0.0), (1.0, 0.1), (60.0, 0.0), (60.0, 0.2)]
    for scale, smoothing in cases:
        logits = _rand(S, B, V, seed=3, scale=scale)
        loss_ref, grad_ref = _reference(logits, target, weights, smoothing)
        local = logits.chunk(tp_size, dim=-1)[rank].clone().requires_grad_(True)
        loss = cross_entropy(local, target, smoothing)
        (loss * weights).sum().backward()
        assert loss.shape == target.shape
        assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
        assert_close(local.grad, grad_ref.chunk(tp_size, dim=-1)[rank], rtol=1e-5, atol=1e-5)

    logits = _rand(S, B, V, seed=4).to(torch.bfloat16)
    loss_ref, grad_ref = _reference(logits.float(), target, weights, 0.0)
    local = logits.chunk(tp_size, dim=-1)[rank].clone().requires_grad_(True)
    loss = cross_entropy(local, target)
    (loss * weights).sum().backward()
    assert loss.dtype == torch.float32 and local.grad.dtype == torch.bfloat16
    assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    assert_close(local.grad.float(), grad_ref.chunk(tp_size, dim=-1)[rank], rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(tp_size: int) -> None:
    run_on_ranks(WORLD, _check_cross_entropy, tp_size)


def test_cross_entropy_rejects_bad_arguments() -> None:
    logits, target = torch.randn(2, 3, 8), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="label_smoothing"):
        tp.vocab_parallel_cross_entropy(logits, target, label_smoothing=1.0)
    with pytest.raises(ValueError, match=r"do not match target of shape \(3, 2\)"):
        tp.vocab_parallel_cross_entropy(logits, target.t())


def test_vocab_utility_ranges() -> None:
    assert tp.VocabUtility.vocab_range_from_global_vocab_size(32, 2, 4) == (16, 24)
    assert tp.VocabUtility.vocab_range_from_per_partition_vocab_size(8, 3, 4) == (24, 32)
    with pytest.raises(ValueError, match=r"vocabulary size \(30\).*\(4\).*pad_vocab_size"):
        tp.VocabUtility.vocab_range_from_global_vocab_size(30, 0, 4)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_fused_cross_entropy_matches_f_cross_entropy(tp_size: int) -> None:
    """``cross_entropy_loss_fusion``'s native kernel: the same loss and logit gradients, fp32 and bf16 logits."""
    run_on_ranks(WORLD, _check_cross_entropy, tp_size, True)
