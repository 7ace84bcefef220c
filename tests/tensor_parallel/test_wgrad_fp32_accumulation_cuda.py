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


def test_compiled_layer_keeps_fused_bf16_wgrad_without_graph_break():
    """A compiled linear layer with gradient_accumulation_fusion: the fp32 main_grad gets dY^T X, no graph break."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(384, 512, device="cuda", dtype=torch.bfloat16) / 20)
    weight.main_grad = torch.zeros(384, 512, device="cuda", dtype=torch.float32)
    weight.grad_added_to_main_grad = False
    weight.wgrad_fused_into_main_grad = True

    def layer(x):
        # No TP communication (allreduce_dgrad and sequence_parallel off), so no group is needed.
        return torch.nn.functional.gelu(
            LinearWithGradAccumulationAndAsyncCommunication.apply(x, weight, None, True, False, False, None, 0, None))

    x = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(layer)
    out = compiled(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    reference_x = x.detach().clone().requires_grad_(True)
    reference_w = weight.detach().clone().requires_grad_(True)
    torch.nn.functional.gelu(reference_x @ reference_w.t()).backward(grad)
    torch.testing.assert_close(weight.main_grad, reference_w.grad.float(), rtol=2e-2, atol=5e-1)
    torch.testing.assert_close(x.grad, reference_x.grad, rtol=2e-2, atol=2e-2)
