"""The MoE experts' weighted SwiGLU backward as one Triton kernel, against autograd of the plain expression.

The kernel runs on CUDA (GPU tests) and, where Triton is installed, in Triton's interpreter on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron_core.fusions.weighted_swiglu_triton import (
    weighted_swiglu_backward,
    weighted_swiglu_backward_supported,
)
from tests.triton_interpreter import needs_triton, run_in_triton_interpreter

# (rows, F): F a multiple of the kernel's 512-column step, one that is not, one narrower than a step
SHAPES = [(6, 1024), (5, 700), (3, 40)]


def _plain(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    y1, y2 = torch.chunk(y.float(), 2, -1)
    return (F.silu(y1) * y2 * weights.float()).to(y.dtype)


def _compare(device: str, dtype: torch.dtype, shape: tuple, compiled: bool = False) -> None:
    rows, ffn = shape
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(rows, 2 * ffn, generator=gen).to(device, dtype)
    weights = torch.rand(rows, 1, generator=gen).to(device)  # fp32 probabilities, as the router gives them
    grad = torch.randn(rows, ffn, generator=gen).to(device, dtype)
    fn = torch.compile(weighted_bias_swiglu_impl, fullgraph=True) if compiled else weighted_bias_swiglu_impl
    y_a, w_a = y.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    y_b, w_b = y.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    out, ref = fn(y_a, None, w_a), _plain(y_b, w_b)
    out.backward(grad)
    ref.backward(grad)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(y_a.grad, y_b.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(w_a.grad, w_b.grad, atol=tol * 10, rtol=tol)  # a sum over F products


def test_not_supported_on_cpu_tensors():
    assert not weighted_swiglu_backward_supported(torch.zeros(2, 8))


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"got \(2, 3\), \(2, 8\) and \(2, 1\)"):
        weighted_swiglu_backward(torch.zeros(2, 3), torch.zeros(2, 8), torch.zeros(2, 1))


_INTERPRETED = """
import torch
import torch.nn.functional as F
from megatron_core.fusions.weighted_swiglu_triton import weighted_swiglu_backward
for rows, ffn in {shapes}:
    y, g, w = torch.randn(rows, 2 * ffn), torch.randn(rows, ffn), torch.rand(rows, 1)
    y_ref, w_ref = y.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y1, y2 = torch.chunk(y_ref, 2, -1)
    (F.silu(y1) * y2 * w_ref).backward(g)
    grad_y, grad_w = weighted_swiglu_backward(g, y, w)
    torch.testing.assert_close(grad_y, y_ref.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_w, w_ref.grad, atol=1e-4, rtol=1e-5)
"""


@needs_triton
def test_kernel_in_the_triton_interpreter():
    run_in_triton_interpreter(_INTERPRETED.format(shapes=SHAPES))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["even", "ragged", "narrow"])
def test_kernel_matches_autograd_cuda(dtype, shape):
    _compare("cuda", dtype, shape)


@pytest.mark.gpu
def test_kernel_under_torch_compile_cuda():
    _compare("cuda", torch.bfloat16, SHAPES[1], compiled=True)
