"""RMSNorm returning its input as the residual (one autograd node), its Triton backward and the layer wiring.

References: autograd of ``F.rms_norm(x, w) `` with ``x`` also used as the residual. The PyTorch fallback runs on
the CPU; the Triton kernel runs on CUDA (GPU tests) and in Triton's interpreter on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core import parallel_state, tensor_parallel
from megatron_core.fusions.fused_rms_norm import (
    rms_norm_backward,
    rms_norm_backward_supported,
    rms_norm_with_residual,
)
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.torch_norm import RMSNorm
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, llama_like
from tests.triton_interpreter import needs_triton, run_in_triton_interpreter

# (leading shape, hidden): rows a multiple of the kernel's 16 per program or not, hidden a power of two or not
SHAPES = [((4, 8), 64), ((37,), 1000), ((3, 1), 40)]


def _compare(device: str, dtype: torch.dtype, lead: tuple, hidden: int, residual_grad: bool = True,
             compiled: bool = False) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, hidden, generator=gen).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    gy, gr = (torch.randn(*lead, hidden, generator=gen).to(device, dtype) for _ in range(2))
    x_a, w_a = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    x_b, w_b = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    fn = torch.compile(rms_norm_with_residual, fullgraph=True) if compiled else rms_norm_with_residual
    y_a, r_a = fn(x_a, w_a, 1e-5)
    y_b = F.rms_norm(x_b, (hidden,), w_b, 1e-5)
    torch.autograd.backward([y_a, r_a] if residual_grad else [y_a], [gy, gr] if residual_grad else [gy])
    torch.autograd.backward([y_b, x_b] if residual_grad else [y_b], [gy, gr] if residual_grad else [gy])
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert torch.equal(r_a, x), "the residual output is the input"
    torch.testing.assert_close(y_a, y_b, atol=tol, rtol=tol)
    torch.testing.assert_close(x_a.grad, x_b.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(w_a.grad, w_b.grad, atol=tol * 10, rtol=tol)  # a sum over every row


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("residual_grad", [True, False], ids=["residual", "no-residual"])
def test_pytorch_backward_matches_autograd_cpu(dtype, residual_grad):
    for lead, hidden in SHAPES:
        _compare("cpu", dtype, lead, hidden, residual_grad)


def test_compiled_on_cpu_matches_autograd():
    _compare("cpu", torch.float32, *SHAPES[1], compiled=True)


def test_not_supported_on_cpu_tensors():
    assert not rms_norm_backward_supported(torch.zeros(2, 8))


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"x \(2, 8\).*weight \(4,\)"):
        rms_norm_backward(torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(2, 1), torch.zeros(4), None)


def test_rms_norm_module_returns_the_residual():
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, normalization="RMSNorm",
                               layernorm_zero_centered_gamma=True)
    norm = RMSNorm(config, 16)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 16)
    y, residual = norm(x, return_residual=True)
    assert residual is not x and torch.equal(residual, x)
    torch.testing.assert_close(y, norm(x))
    torch.testing.assert_close(y, F.rms_norm(x, (16,), norm.weight + 1, norm.eps))


def _layer_grads(returns_residual: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = build(llama_like())
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.returns_residual = returns_residual  # instance override: the plain norm + residual path
    ids, pos, labels = batch(3)
    loss = model(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def _layers_with_and_without_the_fused_residual() -> int:
    parallel_state.initialize_model_parallel()
    try:
        fused, plain = _layer_grads(True), _layer_grads(False)
        for name in plain:
            torch.testing.assert_close(fused[name], plain[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
        return len(plain)
    finally:
        parallel_state.destroy_model_parallel()


def test_transformer_layers_match_the_plain_norm_and_residual():
    """GPTModel's loss and every gradient are the same with the one-node norm + residual as without it (fp32)."""
    checked = run_on_ranks(1, _layers_with_and_without_the_fused_residual)[0]
    assert checked > 5


_INTERPRETED = """
import torch
from megatron_core.fusions.fused_rms_norm import _reference_backward, rms_norm_backward
for lead, hidden in {shapes}:
    for with_residual in (True, False):
        x, gy, gr = (torch.randn(*lead, hidden) for _ in range(3))
        w = torch.randn(hidden)
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        got = rms_norm_backward(gy, x, rstd, w, gr if with_residual else None)
        want = _reference_backward(gy, x, rstd, w, gr if with_residual else None)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-5)
"""


@needs_triton
def test_kernel_in_the_triton_interpreter():
    run_in_triton_interpreter(_INTERPRETED.format(shapes=SHAPES))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("residual_grad", [True, False], ids=["residual", "no-residual"])
def test_kernel_matches_autograd_cuda(dtype, residual_grad):
    for lead, hidden in SHAPES + [((2, 2048), 2048)]:
        _compare("cuda", dtype, lead, hidden, residual_grad)


@pytest.mark.gpu
def test_kernel_under_torch_compile_cuda():
    _compare("cuda", torch.bfloat16, (2, 2048), 2048, compiled=True)
