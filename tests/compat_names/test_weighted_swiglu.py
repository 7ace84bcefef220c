"""``weighted_bias_swiglu_impl`` (the MoE experts' activation times routing probabilities) against autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl


def _reference(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a, b = torch.chunk(y, 2, -1)
    return F.silu(a) * b * w


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_values_and_gradients_match_autograd(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    y = torch.randn(37, 24, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.rand(37, 1, dtype=torch.float64, device=device, requires_grad=True)
    g = torch.randn(37, 12, dtype=torch.float64, device=device)
    out = weighted_bias_swiglu_impl(y, None, w)
    out.backward(g)
    y2, w2 = y.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = _reference(y2, w2)
    ref.backward(g)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(y.grad, y2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="weights"):
        weighted_bias_swiglu_impl(torch.randn(4, 6), None, torch.rand(4))
    with pytest.raises(ValueError, match="bias"):
        weighted_bias_swiglu_impl(torch.randn(4, 6), torch.zeros(6), torch.rand(4, 1))
