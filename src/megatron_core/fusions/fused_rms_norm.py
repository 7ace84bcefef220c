"""RMSNorm that also hands back its input as the residual, with the backward of both in one Triton kernel on CUDA.

A pre-norm layer normalises the residual stream ``x`` and keeps ``x`` for the residual addition, so ``x``'s
gradient is the norm's input gradient plus the residual's. :func:`rms_norm_with_residual` returns ``(y, x)``
as one autograd node: its backward receives both gradients and, on CUDA with Triton, one kernel reads the
output gradient, ``x`` and the residual's gradient once, writes ``x``'s whole gradient and per-program partial
sums of the weight gradient; a second small kernel adds the partial sums up. Traced by Inductor instead, the
same backward takes a row-and-column kernel at about two thirds of the copy bandwidth plus a separate sum over its
partial results (the reference's norm on an H100: 33 + 7 us, against about 22 us for the bytes).

The forward is ``aten._fused_rms_norm`` (``F.rms_norm``'s kernel, which also returns the reciprocal RMS). Off
CUDA, without Triton, or for a shape the kernel does not take, the backward is the same arithmetic in PyTorch ops
(fp32 for half-precision inputs); the kernel agrees with it within fp32 rounding (the weight gradient is summed
in another order).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, next_power_of_two, triton_modules, triton_op

__all__ = ["rms_norm_backward", "rms_norm_backward_supported", "rms_norm_with_residual"]

_MAX_HIDDEN = 16384  # one row in registers; wider rows take the PyTorch-ops backward
_ROWS_PER_PROGRAM = 16  # rows folded into one partial weight-gradient row
_ROWS_PER_STEP = 2  # rows loaded together
_WARPS = 8
_PARTIAL_BLOCK = (32, 32)  # [partial rows, columns] per step of the partial sums' reduction


def rms_norm_backward_supported(x: torch.Tensor) -> bool:
    """Whether :func:`rms_norm_backward` serves ``x`` (CUDA, a floating dtype, hidden <= 16384, Triton installed)."""
    return (x.is_cuda and x.is_floating_point() and 0 < x.shape[-1] <= _MAX_HIDDEN and _BACKWARD_OP is not None
            and have_triton())


def rms_norm_backward(grad_output: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                      grad_residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight)`` of ``y = x * rstd * weight``, ``grad_residual`` (``x``'s other gradient) added.

    ``x`` and ``grad_output`` are ``[..., hidden]``; ``rstd`` is the forward's fp32 ``[..., 1]``. ``grad_x`` has
    ``x``'s dtype, ``grad_weight`` ``weight``'s.
    """
    hidden = x.shape[-1]
    if grad_output.shape != x.shape or weight.shape != (hidden,) or rstd.numel() * hidden != x.numel() \
            or (grad_residual is not None and grad_residual.shape != x.shape):
        raise ValueError(
            f"rms_norm_backward: need grad_output and grad_residual shaped like x {tuple(x.shape)}, weight "
            f"[{hidden}] and one rstd per row; got grad_output {tuple(grad_output.shape)}, weight "
            f"{tuple(weight.shape)}, rstd {tuple(rstd.shape)}, grad_residual "
            f"{None if grad_residual is None else tuple(grad_residual.shape)}"
        )
    if _BACKWARD_OP is None:
        raise RuntimeError("rms_norm_backward needs Triton and a torch with torch.library.triton_op "
                           "(rms_norm_backward_supported says when it runs)")
    rows = x.numel() // hidden
    res = None if grad_residual is None else grad_residual.reshape(rows, hidden).contiguous()
    grad_x, grad_weight = _BACKWARD_OP(grad_output.reshape(rows, hidden).contiguous(), x.reshape(rows, hidden)
                                      .contiguous(), rstd.reshape(rows).contiguous(), weight.contiguous(), res)
    return grad_x.view(x.shape), grad_weight


@functools.cache
def _kernels() -> tuple[Any, Any]:
    triton, tl = triton_modules()

    @triton.jit
    def rms_norm_backward_kernel(dy_ptr, x_ptr, rstd_ptr, w_ptr, dres_ptr, dx_ptr, partial_ptr, rows, hidden,
                                 ROWS: tl.constexpr, SUB: tl.constexpr, BLOCK: tl.constexpr,
                                 HAS_RESIDUAL: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        live = cols < hidden
        w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)[None, :]
        partial = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, ROWS, SUB):
            row = pid * ROWS + start + tl.arange(0, SUB)  # SUB rows at a time: more bytes in flight
            in_range = row < rows
            offs = row[:, None].to(tl.int64) * hidden + cols[None, :]
            mask = in_range[:, None] & live[None, :]
            rstd = tl.load(rstd_ptr + row, mask=in_range, other=0.0)[:, None]
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            xhat = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * rstd
            wdy = w * dy
            mean = tl.sum(xhat * wdy, 1)[:, None] / hidden
            dx = (wdy - xhat * mean) * rstd
            if HAS_RESIDUAL:
                dx += tl.load(dres_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            partial += tl.sum(dy * xhat, 0)
        tl.store(partial_ptr + pid.to(tl.int64) * hidden + cols, partial, mask=live)

    @triton.jit
    def column_sum_kernel(partial_ptr, out_ptr, count, hidden, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        live = cols < hidden
        acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
        for start in range(0, count, BLOCK_P):
            prow = start + tl.arange(0, BLOCK_P)
            mask = (prow[:, None] < count) & live[None, :]
            acc += tl.load(partial_ptr + prow[:, None].to(tl.int64) * hidden + cols[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + cols, tl.sum(acc, 0).to(out_ptr.dtype.element_ty), mask=live)

    return rms_norm_backward_kernel, column_sum_kernel


def _backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
              grad_residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    rows, hidden = x.shape
    grad_x = torch.empty_like(x)
    grad_weight = torch.empty_like(weight)
    if rows == 0:
        return grad_x, grad_weight.zero_()
    programs = -(-rows // _ROWS_PER_PROGRAM)
    partial = torch.empty(programs, hidden, device=x.device, dtype=torch.float32)
    block = next_power_of_two(hidden)
    main, column_sum = (torch.library.wrap_triton(k) for k in _kernels())
    main[(programs,)](dy, x, rstd, weight, grad_residual if grad_residual is not None else dy, grad_x, partial,
                      rows, hidden, ROWS=_ROWS_PER_PROGRAM, SUB=_ROWS_PER_STEP, BLOCK=block,
                      HAS_RESIDUAL=grad_residual is not None, num_warps=_WARPS)
    block_p, block_c = _PARTIAL_BLOCK
    column_sum[(-(-hidden // block_c),)](partial, grad_weight, programs, hidden, BLOCK_P=block_p, BLOCK_C=block_c,
                                         num_warps=4)
    return grad_x, grad_weight


# Registered at import where Triton is installed (the kernels are built on their first launch).
_BACKWARD_OP = triton_op("megatron_core::rms_norm_backward", _backward)


class _RMSNormWithResidual(torch.autograd.Function):
    """``(rms_norm(x, weight), x)`` as one node, so that the backward sees both of ``x``'s gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor | None, grad_residual: torch.Tensor | None) -> tuple:
        x, rstd, weight = ctx.saved_tensors
        if grad_y is None:
            return grad_residual, None, None
        if rms_norm_backward_supported(x):
            grad_x, grad_weight = rms_norm_backward(grad_y, x, rstd, weight, grad_residual)
        else:
            grad_x, grad_weight = _reference_backward(grad_y, x, rstd, weight, grad_residual)
        return grad_x, grad_weight, None


def _reference_backward(grad_y: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                        grad_residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward in PyTorch ops (fp32 for half-precision inputs): the kernel's reference and its fallback."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xhat = x.to(compute) * rstd.to(compute)
    wdy = weight.to(compute) * grad_y.to(compute)
    grad_x = (wdy - xhat * (wdy * xhat).mean(-1, keepdim=True)) * rstd.to(compute)
    if grad_residual is not None:
        grad_x = grad_x + grad_residual.to(compute)
    grad_weight = (grad_y.to(compute) * xhat).reshape(-1, x.shape[-1]).sum(0)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


def rms_norm_with_residual(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.rms_norm(x, (hidden,), weight, eps), x)``; use the second output as the residual so both gradients meet."""
    return _RMSNormWithResidual.apply(x, weight, eps)
