"""The CUTLASS grouped GEMM as a PyTorch operator with its gradient (``torch.library``, so it compiles too).

``grouped_mm(a, weight, offs, transpose_weight)`` multiplies the rows of group ``e`` of ``a`` (``[T, K]``; the
groups end at the int32 device offsets ``offs``, the last at ``T``) by ``weight[e]^T`` (``weight [E, N, K]``,
``transpose_weight=True``) or by ``weight[e]`` (``weight [E, K, N]``). Its backward runs the data gradient on the
same kernel and the weight gradient (a GEMM over each group's rows) on PyTorch's ``grouped_mm``.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from megatron_core.transformer.moe.cutlass_grouped_gemm.build import library_path

__all__ = ["grouped_mm"]

_ERRORS = {-2: "N or K is not a multiple of 8", -3: "a pointer is not 16-byte aligned", -4: "workspace too small"}


@functools.cache
def _library() -> ctypes.CDLL:
    library = ctypes.CDLL(str(library_path()))
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    for name in ("mcore_gmm_tn", "mcore_gmm_nn"):
        function = getattr(library, name)
        function.argtypes = [pointer, pointer, pointer, pointer, ctypes.c_int, ctypes.c_int, ctypes.c_int, pointer,
                             size, pointer]
        function.restype = ctypes.c_int
    library.mcore_gmm_workspace_bytes.argtypes = [ctypes.c_int]
    library.mcore_gmm_workspace_bytes.restype = size
    return library


@functools.cache
def _workspace_bytes(groups: int, device: int) -> int:
    with torch.cuda.device(device):
        return int(_library().mcore_gmm_workspace_bytes(groups))


def _launch(a: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, out: torch.Tensor,
            transpose_weight: bool) -> None:
    """Run the kernel on the current stream, writing ``out``."""
    groups, n, k = weight.shape[0], out.shape[1], a.shape[1]
    workspace = torch.empty(_workspace_bytes(groups, a.device.index), dtype=torch.uint8, device=a.device)
    library = _library()
    function = library.mcore_gmm_tn if transpose_weight else library.mcore_gmm_nn
    code = function(a.data_ptr(), weight.data_ptr(), out.data_ptr(), offs.data_ptr(), groups, n, k,
                    workspace.data_ptr(), workspace.numel(), torch.cuda.current_stream(a.device).cuda_stream)
    if code != 0:
        raise RuntimeError(f"CUTLASS grouped GEMM ({'tn' if transpose_weight else 'nn'}, a {tuple(a.shape)}, "
                           f"weight {tuple(weight.shape)}) failed with code {code}: "
                           f"{_ERRORS.get(code, 'see grouped_gemm_sm90.cu for the codes')}")


def _out_columns(weight: torch.Tensor, transpose_weight: bool) -> int:
    return weight.shape[1] if transpose_weight else weight.shape[2]


@torch.library.custom_op("megatron_core::cutlass_grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, transpose_weight: bool) -> torch.Tensor:
    """``cat_e(a_e @ weight[e]^T)`` (``transpose_weight``) or ``cat_e(a_e @ weight[e])`` on the CUTLASS kernel."""
    a, weight = a.contiguous(), weight.contiguous()
    out = a.new_empty(a.shape[0], _out_columns(weight, transpose_weight))
    _launch(a, weight, offs, out, transpose_weight)
    return out


@grouped_mm.register_fake
def _(a: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, transpose_weight: bool) -> torch.Tensor:
    return a.new_empty(a.shape[0], _out_columns(weight, transpose_weight))


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    a, weight, offs, transpose_weight = inputs
    ctx.save_for_backward(a, weight, offs)
    ctx.transpose_weight = transpose_weight


def weight_gradient(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, transpose_weight: bool) -> torch.Tensor:
    """Each group's ``grad_e^T @ a_e`` (``[E, N, K]``, ``transpose_weight``) or ``a_e^T @ grad_e`` (``[E, K, N]``),
    by PyTorch's grouped GEMM over each group's rows (the kernel PyTorch's own backward of ``grouped_mm`` uses)."""
    if transpose_weight:
        return torch._grouped_mm(grad.t(), a, offs=offs)
    return torch._grouped_mm(a.t(), grad, offs=offs)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    a, weight, offs = ctx.saved_tensors
    grad = grad.contiguous()
    grad_a = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_a = grouped_mm(grad, weight, offs, not ctx.transpose_weight)
    if ctx.needs_input_grad[1]:
        grad_weight = weight_gradient(a, grad, offs, ctx.transpose_weight)
    return grad_a, grad_weight, None, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)
