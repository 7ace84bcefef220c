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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_write_on_cuda_does_not_read_the_stale_main_grad(dtype):
    """beta = 0 on cuBLAS (same-dtype GEMM and the fp32-accumulating one): NaN in main_grad is not read."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    grad_output = torch.randn(256, 384, device="cuda", dtype=dtype)
    inputs = torch.randn(256, 512, device="cuda", dtype=dtype)
    main_grad = torch.full((384, 512), float("nan"), device="cuda", dtype=torch.float32)
    try:
        for tokens in (256, 0):  # a GEMM without tokens (an expert without tokens) writes zeros
            main_grad.fill_(float("nan"))
            wgrad_accumulation.expect_first_write([main_grad])
            wgrad_accumulation.accumulate_weight_gradient(main_grad, grad_output[:tokens], inputs[:tokens])
            want = grad_output[:tokens].float().t() @ inputs[:tokens].float()
            torch.testing.assert_close(main_grad, want, rtol=2e-2, atol=5e-1)
        print("one-GEMM fp32 accumulation:", wgrad_accumulation.gemm_accumulates_into_fp32(main_grad.device))
    finally:
        wgrad_accumulation.zero_pending_first_writes()


def test_capturing_a_pending_first_write_in_a_cuda_graph_raises():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    grad_output = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    inputs = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.zeros(32, 48, device="cuda", dtype=torch.float32)
    wgrad_accumulation.accumulate_weight_gradient(main_grad, grad_output, inputs)  # warm-up outside the capture
    torch.cuda.synchronize()
    wgrad_accumulation.expect_first_write([main_grad])
    try:
        with pytest.raises(RuntimeError, match="CUDA graph"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                wgrad_accumulation.accumulate_weight_gradient(main_grad, grad_output, inputs)
        assert [t.data_ptr() for t in wgrad_accumulation.pending_first_writes()] == [main_grad.data_ptr()]
    finally:
        wgrad_accumulation.zero_pending_first_writes()
