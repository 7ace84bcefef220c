"""The weight-gradient GEMM of ``gradient_accumulation_fusion``: ``main_grad += dY^T X`` in one step.

Eagerly it is called directly. Inside ``torch.compile``d backward graphs it is the custom op
``torch.ops.megatron_core.accumulate_weight_gradient`` (it mutates ``main_grad``), so that the
compiled graph calls the same kernel instead of tracing it (torch 2.11's fake kernel of
``addmm(..., out_dtype=)`` fails) and the layer needs no graph break.
"""

from __future__ import annotations

import torch

__all__ = ["accumulate_weight_gradient", "gemm_accumulates_into_fp32"]

_FP32_ACCUMULATING_GEMM: dict[str, bool] = {}


def gemm_accumulates_into_fp32(device: torch.device) -> bool:
    """Whether ``addmm(fp32, bf16, bf16, out_dtype=fp32, out=fp32)`` works on ``device`` (checked once, on CUDA).

    Newer PyTorch builds run it on CUDA as one cuBLAS GEMM with an fp32 C operand; the check compares a
    small product against the two-step result, so a build without it (or a wrong one) keeps the fallback.
    """
    if device.type != "cuda":
        return False
    key = str(device)
    if key not in _FP32_ACCUMULATING_GEMM:
        try:
            a = torch.randn(64, 32, device=device, dtype=torch.bfloat16)
            b = torch.randn(32, 48, device=device, dtype=torch.bfloat16)
            acc = torch.randn(64, 48, device=device, dtype=torch.float32)
            want = acc + (a @ b).float()
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            ok = bool(torch.allclose(acc, want, rtol=2e-2, atol=2e-1))
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _FP32_ACCUMULATING_GEMM[key] = ok
    return _FP32_ACCUMULATING_GEMM[key]


def accumulate_weight_gradient(main_grad: torch.Tensor, grad_output_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    """``main_grad += grad_output_2d^T @ input_2d`` (``[out, in]`` from ``[tokens, out]`` and ``[tokens, in]``)."""
    if main_grad.dtype == grad_output_2d.dtype:
        main_grad.addmm_(grad_output_2d.t(), input_2d)  # one GEMM that accumulates in place
    elif gemm_accumulates_into_fp32(main_grad.device):
        # bf16/fp16 operands on tensor cores, the product added to the fp32 main_grad inside the GEMM.
        torch.addmm(main_grad, grad_output_2d.t(), input_2d, out_dtype=main_grad.dtype, out=main_grad)
    else:
        # bf16/fp16 activations with an fp32 main_grad: the GEMM runs in the activation dtype (tensor
        # cores, fp32 accumulation inside) and its result is added in fp32, as the unfused DDP hook does;
        # upcasting the operands instead would run the GEMM in fp32, many times slower on a GPU.
        main_grad.add_(grad_output_2d.t().matmul(input_2d))


# Defined with the plain ``torch.library.Library`` API rather than ``torch.library.custom_op``: the dispatcher then
# calls the Python function directly, without custom_op's Python autograd / view / checking layers (about 60 us
# per call on the host; a backward makes four calls per layer).
_LIBRARY = torch.library.Library("megatron_core", "FRAGMENT")
_LIBRARY.define("accumulate_weight_gradient(Tensor(a!) main_grad, Tensor grad_output_2d, Tensor input_2d) -> ()")
_LIBRARY.impl("accumulate_weight_gradient", accumulate_weight_gradient, "CompositeExplicitAutograd")


@torch.library.register_fake("megatron_core::accumulate_weight_gradient", lib=_LIBRARY)
def _(main_grad: torch.Tensor, grad_output_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    return None
