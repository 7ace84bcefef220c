"""On CUDA, bf16 weight gradients accumulate into the fp32 ``main_grad`` inside the GEMM (GPU only)."""

from __future__ import annotations

import pytest
import torch

from megatron_core.tensor_parallel import wgrad_accumulation
from megatron_core.tensor_parallel.linear_function import LinearWithGradAccumulationAndAsyncCommunication

pytestmark = pytest.mark.gpu


def test_fused_wgrad_accumulates_into_fp32_main_grad():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    x = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(384, 512, device="cuda", dtype=torch.bfloat16) / 20)
    weight.main_grad = torch.randn(384, 512, device="cuda", dtype=torch.float32)
    weight.grad_added_to_main_grad = False
    start = weight.main_grad.clone()
    # No TP communication (allreduce_dgrad and sequence_parallel off), so no group is needed.
    out = LinearWithGradAccumulationAndAsyncCommunication.apply(x, weight, None, True, False, False, None, 0, None)
    grad = torch.randn_like(out)
    out.backward(grad)
    print("one-GEMM fp32 accumulation:", wgrad_accumulation.gemm_accumulates_into_fp32(x.device))
    want = start + (grad.float().reshape(-1, 384).t() @ x.detach().float().reshape(-1, 512))
    torch.testing.assert_close(weight.main_grad, want, rtol=2e-2, atol=5e-1)
    assert weight.grad_added_to_main_grad
