"""The FP8 weight-gradient GEMM that accumulates into ``main_grad`` (Triton, Hopper) against fp32 and the unfused path.

``c += (a / a_scale) @ (b / b_scale).T`` with e5m2 x e4m3 operands (``fp8='hybrid'``) and e4m3 x e4m3, shapes that
are not multiples of the tiles (the descriptors read zeros past the edges, the stores are masked), ``c`` in bf16 and
fp32: within one bf16 rounding (relative to max(|c|, 1)) of the fp32 product of the same float8 values, and no further
from it than 1.5 times the unfused ``_scaled_mm`` (split accumulation) + add. Hopper's float8 accumulator keeps
fewer bits than fp32: the kernel promotes it into fp32 every tile of the reduction, as cuBLAS does. Off Hopper the kernel does not serve and the op keeps the add.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.fp8.wgrad_gemm import accumulate_kernel_serves, fp8_gemm_accumulate


def test_kernel_serves_only_aligned_float8_cuda_operands():
    a = torch.zeros(8, 32, dtype=torch.float8_e4m3fn)
    assert not accumulate_kernel_serves(torch.zeros(8, 8), a, a)  # CPU
    with pytest.raises(ValueError, match="needs a"):
        fp8_gemm_accumulate(torch.zeros(8, 9), a, torch.ones(()), a, torch.ones(()))


@pytest.mark.gpu
@pytest.mark.parametrize("c_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("a_dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_accumulating_gemm_equals_fp32_within_one_rounding(a_dtype, c_dtype):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in ((1000, 720, 1040), (5120, 3072, 4096), (48, 200, 16)):
        a_scale, b_scale = torch.tensor(3.0, device="cuda"), torch.tensor(0.5, device="cuda")
        a = (torch.randn(m, k, device="cuda", generator=gen) * a_scale).to(a_dtype)
        b = (torch.randn(n, k, device="cuda", generator=gen) * b_scale).to(torch.float8_e4m3fn)
        c = torch.randn(m, n, device="cuda", generator=gen).to(c_dtype)
        want = c.float() + (a.float() / a_scale) @ (b.float() / b_scale).t()
        unfused = c.clone()
        unfused.add_(torch._scaled_mm(a, b.t(), scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(),
                                      out_dtype=c_dtype))
        assert accumulate_kernel_serves(c, a, b)
        fp8_gemm_accumulate(c, a, a_scale, b, b_scale)
        error = ((c.float() - want).abs() / want.abs().clamp(min=1.0)).max().item()
        unfused_error = ((unfused.float() - want).abs() / want.abs().clamp(min=1.0)).max().item()
        assert error <= 2.0 ** -8, (m, n, k, error)  # within one bf16 rounding
        assert error <= 1.5 * unfused_error + 1e-5, (m, n, k, error, unfused_error)
