"""An optional grouped GEMM for the experts on Hopper GPUs, built from CUTLASS (``MEGATRON_CORE_MOE_GROUPED_GEMM``).

PyTorch's ``grouped_mm`` rounds every expert's rows up to a multiple of 256 on an H100/H200 (128x256 tiles in
2-CTA clusters along the rows), so with about a thousand rows per expert 10-30% of its tiles are padding. This
kernel uses 128-row tiles (128x128x64, 1x2 clusters along the columns, ping-pong). On one H200 the four forward
and data-gradient GEMMs of a Mixtral-shaped layer took 1.86 ms against 1.94 ms for ``grouped_mm`` at
near-uniform routing (4% less) and 8% less with an empty expert, but 2% more at a skewed routing and 12% more
when every expert has exactly 1024 rows (``benchmarks/RESULTS.md``, session 20). In a whole compiled
Mixtral-shaped training step on one H100, though, it was slower (77.1 against 71.5 ms; session 21): PyTorch's
kernel is faster on the row counts the library produces than on the microbenchmark's. It is therefore opt-in:

    MEGATRON_CORE_MOE_GROUPED_GEMM=cutlass   # default: torch; or set_moe_grouped_gemm_backend("cutlass")

Then the grouped experts (``TEGroupedMLP`` / ``GroupedMLP`` layouts) run their forward and data-gradient GEMMs
on it (the weight gradient stays on PyTorch's kernel) wherever PyTorch's ``grouped_mm`` would have run them in
bf16 on a compute-capability 9.0 GPU. It needs ``nvcc`` and the CUTLASS headers (``pip install
nvidia-cutlass``; see :mod:`.build`); asking for it where it cannot run raises an error that says why.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["BACKEND_ENV", "check_cutlass_grouped_gemm", "cutlass_grouped_gemm_requested", "cutlass_grouped_linear",
           "set_moe_grouped_gemm_backend"]

BACKEND_ENV = "MEGATRON_CORE_MOE_GROUPED_GEMM"
_BACKENDS = ("torch", "cutlass")


_backend = os.environ.get(BACKEND_ENV, "torch").strip().lower() or "torch"


def set_moe_grouped_gemm_backend(backend: str) -> None:
    """Choose the experts' grouped GEMM in code: ``"torch"`` or ``"cutlass"`` (as the environment variable)."""
    global _backend
    if backend not in _BACKENDS:
        raise ValueError(f"grouped GEMM backend {backend!r}: choose one of {list(_BACKENDS)}")
    _backend = backend


def cutlass_grouped_gemm_requested() -> bool:
    """Whether the CUTLASS kernel was asked for (``MEGATRON_CORE_MOE_GROUPED_GEMM``, read when this module is
    imported, or :func:`set_moe_grouped_gemm_backend`); ``ValueError`` when the variable names neither backend."""
    if _backend not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={_backend!r}: choose one of {list(_BACKENDS)}")
    return _backend == "cutlass"


@functools.cache
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _check_shapes(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> None:
    """``ValueError`` unless ``x [T, in]``, ``weight [E, out, in]`` and ``offs [E]`` fit together (the kernel
    would otherwise read past them)."""
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"CUTLASS grouped GEMM: x {tuple(x.shape)} must be [T, in] and weight {tuple(weight.shape)} "
                         "[experts, out, in] with the same in")
    if offs.dim() != 1 or offs.numel() != weight.shape[0]:
        raise ValueError(f"CUTLASS grouped GEMM: offs {tuple(offs.shape)} must hold one end offset per expert "
                         f"({weight.shape[0]})")


def check_cutlass_grouped_gemm(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise ``ValueError`` naming what keeps the kernel from ``x @ weight[e]^T`` (device, dtype, shapes)."""
    if x.device.type != "cuda":
        raise ValueError(f"{BACKEND_ENV}=cutlass needs CUDA tensors, got {x.device}")
    capability = _device_capability(x.device.index if x.device.index is not None else torch.cuda.current_device())
    if capability != (9, 0):
        raise ValueError(f"{BACKEND_ENV}=cutlass needs a compute-capability 9.0 GPU (H100/H200), this one is "
                         f"{capability[0]}.{capability[1]}")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"{BACKEND_ENV}=cutlass runs bf16 only, got {x.dtype} x {weight.dtype}")
    if weight.shape[1] % 8 or weight.shape[2] % 8:
        raise ValueError(f"{BACKEND_ENV}=cutlass needs expert weight sizes divisible by 8, got "
                         f"{tuple(weight.shape[1:])}")


def cutlass_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``cat_e(x_e @ weight[e]^T)`` for ``weight [E, out, in]`` and the groups of ``x`` ending at ``offs``
    (int32, on the device, the last equal to ``x.shape[0]``); differentiable in ``x`` and ``weight``."""
    from megatron_core.transformer.moe.cutlass_grouped_gemm.ops import grouped_mm

    _check_shapes(x, weight, offs)
    check_cutlass_grouped_gemm(x, weight)
    return grouped_mm(x, weight, offs.to(torch.int32), True)
