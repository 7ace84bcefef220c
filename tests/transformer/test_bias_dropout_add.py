"""``bias_dropout_add``: values against the plain expression, and the residual add fused into a GEMM when compiled."""

from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

from megatron_core.fusions.fused_bias_dropout import bias_dropout_add


def test_values_match_the_plain_expression():
    gen = torch.Generator().manual_seed(0)
    x, residual, bias = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen), torch.randn(8)
    torch.testing.assert_close(bias_dropout_add((x, None), residual, 0.1, False), residual + x, rtol=0, atol=0)
    torch.testing.assert_close(bias_dropout_add((x, bias), residual, 0.0, True), residual + (x + bias),
                               rtol=0, atol=0)
    fp32_residual = residual.double()
    out = bias_dropout_add((x, None), fp32_residual, 0.0, True)
    assert out.dtype == torch.float64 and out.shape == residual.shape
    torch.testing.assert_close(out, fp32_residual + x, rtol=0, atol=0)


def test_a_gemm_output_is_added_in_the_gemm_when_compiled():
    """Inductor turns ``mm`` + the residual add into one ``addmm`` (cuBLAS adds in its epilogue on a GPU)."""
    weight = torch.randn(16, 32)

    def layer_end(h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return bias_dropout_add((torch.matmul(h, weight.t()), None), residual, 0.0, True)

    h, residual = torch.randn(8, 2, 32), torch.randn(8, 2, 16)
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(layer_end), h, residual)
    torch.testing.assert_close(out, residual + h @ weight.t(), rtol=1e-5, atol=1e-5)
    assert "addmm" in code[0]
