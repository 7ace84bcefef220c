"""The float8 GEMM that adds into its output through cuBLASLt (``fp8.cublaslt``), the FP8 weight gradient's.

GPU: ``out += (a * sa) @ (b_t * sb).T`` against ``out + torch._scaled_mm(...)`` (same descriptor, fast accumulation
off) for e4m3 x e5m2 / e4m3 x e4m3 operands and fp32 / bf16 outputs, at a layer's weight-gradient shapes (tokens as
the reduction): fp32 results equal within what another fp32 summation order gives (1e-5 of the sum of the terms'
magnitudes), bf16 within two bf16 roundings more (the product's and the sum's, as the unfused path); two calls add twice; a CUDA graph records and replays the call. Shapes and dtypes cuBLASLt cannot serve are
declined (the caller's fallback then runs). CPU: every CPU tensor is declined.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.fp8 import cublaslt

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_cpu_tensors_are_declined():
    out, a, b_t = torch.zeros(16, 32), torch.zeros(16, 64).to(E5M2), torch.zeros(32, 64).to(E4M3)
    assert not cublaslt.accumulates(out, a, b_t)


def _needs_fp8_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability >= 8.9)")


def _operands(m: int, n: int, k: int, a_dtype: torch.dtype, b_dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = (torch.randn(m, k, device="cuda", generator=gen) * 4).to(a_dtype)
    b_t = (torch.randn(n, k, device="cuda", generator=gen) * 4).to(b_dtype)
    sa = torch.tensor(0.37, device="cuda")
    sb = torch.tensor(1.9, device="cuda")
    return a, sa, b_t, sb


@pytest.mark.gpu
@pytest.mark.parametrize("a_dtype, b_dtype", [(E5M2, E4M3), (E4M3, E4M3), (E4M3, E5M2)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k", [(256, 384, 1024), (1024, 720, 1040), (4096, 1024, 4096)])
def test_accumulating_gemm_equals_scaled_mm_plus_add(a_dtype, b_dtype, out_dtype, m, n, k):
    _needs_fp8_gpu()
    a, sa, b_t, sb = _operands(m, n, k, a_dtype, b_dtype)
    start = torch.randn(m, n, device="cuda").to(out_dtype)
    product = torch._scaled_mm(a, b_t.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32, use_fast_accum=False)
    want = start.float() + product
    out = start.clone()
    assert cublaslt.accumulates(out, a, b_t)
    cublaslt.scaled_mm_accumulate_(out, a, sa, b_t, sb)
    # Two cuBLAS algorithms may order the fp32 accumulation differently: a few fp32 steps of the sum of |terms|.
    terms = (a.float().abs() @ b_t.float().abs().t()) * sa * sb
    slack = 1e-5 * terms + 1e-6 * start.float().abs()
    # bf16: the product rounded, then the sum (as the unfused GEMM to bf16 and its add): two roundings.
    tol = slack if out_dtype == torch.float32 else slack + 2.0 ** -7 * want.abs()
    assert ((out.float() - want).abs() <= tol).all(), (out.float() - want).abs().max()
    cublaslt.scaled_mm_accumulate_(out, a, sa, b_t, sb)  # a second call adds again
    twice = start.float() + 2 * product
    tol = 2 * slack if out_dtype == torch.float32 else 2 * slack + 2.0 ** -6 * twice.abs()
    assert ((out.float() - twice).abs() <= tol).all(), (out.float() - twice).abs().max()


@pytest.mark.gpu
def test_a_cuda_graph_replays_the_accumulating_gemm():
    _needs_fp8_gpu()
    a, sa, b_t, sb = _operands(512, 256, 2048, E5M2, E4M3)
    out = torch.zeros(512, 256, device="cuda")
    cublaslt.scaled_mm_accumulate_(out, a, sa, b_t, sb)  # outside a capture first: the workspace
    once = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cublaslt.scaled_mm_accumulate_(out, a, sa, b_t, sb)
    torch.cuda.synchronize()
    assert torch.equal(out, once)  # capturing ran nothing
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    # The capture stream had no workspace: its algorithm needs none and may sum in another order.
    terms = (a.float().abs() @ b_t.float().abs().t()) * sa * sb
    assert ((out - 3 * once).abs() <= 3e-5 * terms).all(), (out - 3 * once).abs().max()


@pytest.mark.gpu
def test_what_cublaslt_cannot_serve_is_declined():
    _needs_fp8_gpu()
    a, _, b_t, _ = _operands(256, 384, 1024, E5M2, E5M2)
    assert not cublaslt.accumulates(torch.zeros(256, 384, device="cuda"), a, b_t)  # no e5m2 x e5m2 GEMM
    a, _, b_t, _ = _operands(256, 384, 1024, E5M2, E4M3)
    assert not cublaslt.accumulates(torch.zeros(384, 256, device="cuda").t(), a, b_t)  # not contiguous
    assert not cublaslt.accumulates(torch.zeros(256, 384, device="cuda"), a[:, :1000], b_t[:, :1000])  # strided
    assert not cublaslt.accumulates(torch.zeros(256, 384, device="cuda", dtype=torch.float64), a, b_t)
    assert cublaslt.accumulates(torch.zeros(256, 384, device="cuda"), a, b_t)
