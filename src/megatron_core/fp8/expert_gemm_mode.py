"""How the FP8 experts' GEMMs run on Hopper: one grouped GEMM each, one GEMM per expert, or grouped forward GEMMs and
per-expert backward ones.

``grouped`` (the default): ``torch._scaled_grouped_mm`` over all experts, the group offsets on the device (no host
sync). ``per_expert``: one ``torch._scaled_mm`` per expert with rows, inside opaque ops that size each expert's GEMM
from the group ends on the host and write every expert's result into one output:

- ``megatron_core::fp8_per_expert_mm`` for the forward and the data gradient (each expert's rows of ``a``);
- ``megatron_core::fp8_per_expert_wgrad_mm`` for the weight gradient, whose contraction is each expert's rows: its
  operands are column slices of the transposed codes (``[out, L]`` and ``[in, L]``, row-major), which cuBLASLt reads
  in place (the leading dimension ``L`` and every slice start are multiples of 16), so nothing is packed; the cast
  that writes them pads each expert's columns with zeros to a multiple of 128 tokens, which cuBLAS's row-wise-scaled
  kernels run faster (``WGRAD_K_ALIGN``). (An FP8
  parameter whose weight gradient is accumulated into ``main_grad`` inside the GEMM, ``ACCUMULATE_WGRAD_IN_GEMM``,
  keeps that grouped kernel.)

``per_expert_backward``: the forward's GEMMs grouped, the backward's (data and weight gradients) per expert.

Both per-expert modes copy the group ends into pinned host memory without waiting
(``megatron_core::fp8_group_ends_to_host_async``, its CUDA event kept), once per grouped layer and micro-batch, in
the forward (:func:`per_expert_host_ends`; once per expert MLP: fc1 makes the copy for fc2 too, and the layout
carries it, ``AlignedRows.host_ends``). The first per-expert GEMM waits for that copy. In ``per_expert`` mode that is
the forward's first GEMM, by which time the host has queued the kernels before it (the input's cast): the GPU runs
them while the host wakes, instead of draining at every MoE layer (as it did when the forward read the ends at once:
about 0.3 ms of idle GPU per layer and micro-batch, benchmarks/RESULTS.md session 54). In ``per_expert_backward``
mode it is the backward's first GEMM, long after the copy, so a step's host runs ahead of the GPU through the
forward. The host copy, saved for the backward, makes the layer's data-gradient and weight-gradient GEMMs per-expert
ones in both modes, and the forward's in ``per_expert`` mode (:func:`forward_host_ends`).

On an H100 at Mixtral 8x7B's expert shapes the forward and data-gradient GEMMs took 0-17% less time than the grouped
kernel in isolation (``benchmarks/RESULTS.md``, session 46); the grouped weight-gradient GEMM, whose groups split the
contraction, ran at about 700 TFLOP/s in a training step (session 47). All modes take the same e4m3 codes and
row-wise scales, so they compute the same products (the per-expert GEMMs with a long contraction run tensorwise
and their power-of-two scales are applied to the product after, which is exact:
``scaled_grouped_mm.scales_after_gemm``).

Chosen with ``set_fp8_expert_gemm("per_expert")`` or the environment variable ``MEGATRON_CORE_FP8_EXPERT_GEMM``
(read at import; an unknown value raises, naming it, on first use). The per-expert modes' host copies cannot be
captured by CUDA graphs (a capture refuses them, naming the mode), so the default stays ``grouped``; which is
fastest in a training step is measured in ``benchmarks/RESULTS.md`` (sessions 50-54).
"""

from __future__ import annotations

import inspect
import itertools
import os
from collections.abc import Iterator

import torch

from megatron_core import device

__all__ = ["EXPERT_GEMM_ENV", "EXPERT_GEMM_MODES", "forward_host_ends", "fp8_expert_gemm", "group_ends_to_host_async",
           "per_expert_host_ends", "per_expert_mm", "per_expert_wgrad_mm", "set_fp8_expert_gemm"]

EXPERT_GEMM_ENV = "MEGATRON_CORE_FP8_EXPERT_GEMM"
EXPERT_GEMM_MODES = ("grouped", "per_expert", "per_expert_backward")
# Read at import when valid (so compiled code finds it set and is not traced twice); an unknown value is left for
# fp8_expert_gemm() to refuse on first use (importing never fails).
_mode: str | None = os.environ.get(EXPERT_GEMM_ENV, "grouped")
_mode = _mode if _mode in EXPERT_GEMM_MODES else None


def _checked(mode: str, source: str) -> str:
    if mode not in EXPERT_GEMM_MODES:
        raise ValueError(f"{source}={mode!r}: the FP8 experts' GEMM mode must be one of {EXPERT_GEMM_MODES}")
    return mode


def set_fp8_expert_gemm(mode: str) -> None:
    """Run the FP8 experts' GEMMs as ``grouped`` or ``per_expert`` (module docstring)."""
    global _mode
    _mode = _checked(mode, "set_fp8_expert_gemm: mode")


def fp8_expert_gemm() -> str:
    """The current mode: set by :func:`set_fp8_expert_gemm`, else ``MEGATRON_CORE_FP8_EXPERT_GEMM``, else
    ``grouped``."""
    global _mode
    if _mode is None:
        _mode = _checked(os.environ.get(EXPERT_GEMM_ENV, "grouped"), EXPERT_GEMM_ENV)
    return _mode


def _refuse_capture(op: str, tensor: torch.Tensor) -> None:
    if device.is_capturing(tensor):
        raise RuntimeError(f"{op}: the per_expert and per_expert_backward FP8 experts' GEMMs copy the group ends to "
                           "the host, which a CUDA graph capture cannot do; use set_fp8_expert_gemm('grouped') with "
                           "CUDA graphs")


# The ops below read device values on the host: Inductor's CUDA-graph partitions (``mode="reduce-overhead"``) leave
# them out of every graph by this tag (where torch has it; without it a capture refuses them, ``_refuse_capture``).
_HOST_READ_TAGS = ({"tags": (torch.Tag.cudagraph_unsafe,)} if hasattr(torch.Tag, "cudagraph_unsafe")
                   and "tags" in inspect.signature(torch.library.custom_op).parameters else {})


# The host copies of group ends still on their way (``group_ends_to_host_async``): the event each one's copy
# recorded, by the address of its pinned memory; waited on, and dropped, by the first reader (``_group_sizes``). An
# address is taken by one live copy at a time, and a new copy replaces what an earlier one there left.
_PENDING_HOST_ENDS: dict[int, torch.cuda.Event] = {}
_PENDING_LIMIT = 4096  # past this many unread copies (forwards without a backward) the oldest is waited for, forgotten


@torch.library.custom_op("megatron_core::fp8_group_ends_to_host_async", mutates_args=(), **_HOST_READ_TAGS)
def group_ends_to_host_async(ends: torch.Tensor) -> torch.Tensor:
    """A host copy of ``ends`` that arrives later: a non-blocking copy into pinned memory, its event kept for the
    first reader (:func:`_group_sizes` waits on it); a plain copy for host tensors. Refused inside a CUDA graph
    capture, naming the mode."""
    if not ends.is_cuda:
        return ends.to("cpu", copy=True)
    _refuse_capture("fp8_group_ends_to_host_async", ends)
    host = torch.empty(ends.shape, dtype=ends.dtype, device="cpu", pin_memory=True)
    host.copy_(ends, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    if len(_PENDING_HOST_ENDS) >= _PENDING_LIMIT:  # waited for first, so a late reader never finds it unfinished
        _PENDING_HOST_ENDS.pop(next(iter(_PENDING_HOST_ENDS))).synchronize()
    _PENDING_HOST_ENDS[host.data_ptr()] = event
    return host


@group_ends_to_host_async.register_fake
def _(ends: torch.Tensor) -> torch.Tensor:
    return torch.empty(ends.shape, dtype=ends.dtype, device="cpu")


def per_expert_host_ends(ends: torch.Tensor, known: torch.Tensor | None = None) -> torch.Tensor | None:
    """The host copy of ``ends`` that a grouped layer's per-expert GEMMs share: ``known`` where the caller made it
    already (one copy for an expert MLP's fc1 and fc2, ``AlignedRows.host_ends``), else a copy made here without
    waiting (:func:`group_ends_to_host_async`; the first GEMM that reads it waits); ``None`` in ``grouped`` mode."""
    if fp8_expert_gemm() == "grouped":
        return None
    return group_ends_to_host_async(ends) if known is None else known


def forward_host_ends(host_ends: torch.Tensor | None) -> torch.Tensor | None:
    """What sizes the forward's GEMMs: ``host_ends`` in ``per_expert`` mode (one GEMM per expert), ``None`` (the
    grouped kernel, nothing read on the host) in the other modes."""
    return host_ends if fp8_expert_gemm() == "per_expert" else None


def _group_sizes(ends: torch.Tensor) -> list[int]:
    """Every expert's row count, from the groups' end offsets (read to the host unless there; a copy still on its
    way, :func:`group_ends_to_host_async`, waited for first)."""
    event = _PENDING_HOST_ENDS.pop(ends.data_ptr(), None) if ends.device.type == "cpu" else None
    if event is not None:
        event.synchronize()
    ends = ends.tolist()
    return [end - start for start, end in zip([0] + ends[:-1], ends)]


@torch.library.custom_op("megatron_core::fp8_per_expert_mm", mutates_args=(), **_HOST_READ_TAGS)
def per_expert_mm(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor, b_scale: torch.Tensor | None,
                  ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``cat_e(a_e @ b[e])`` with one ``torch._scaled_mm`` per expert that has rows.

    ``a [M, K]`` e4m3 row-major with dequantizing scales ``a_scale [M]`` (one per row); ``b [E, K, N]`` e4m3, each
    ``b[e]`` column-major, with ``b_scale [E, N]`` (one per column of each expert) or ``None`` (ones); ``ends [E]``
    the groups' end rows (the last ``M``), read to the host here unless already there. Returns ``[M, N]`` in
    ``out_dtype``. Without either scale (both ``None``) the GEMMs are cuBLAS's tensorwise kernels with unit scales
    and the result is the unscaled product, whose scales the caller applies.
    """
    _refuse_capture("fp8_per_expert_mm", a)
    if a_scale is None and b_scale is not None:
        raise ValueError("fp8_per_expert_mm: a_scale is None but b_scale is given; the unscaled product (tensorwise "
                         "kernels) takes neither scale")
    out = a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype)
    for rows, a_e, b_e, a_scale_e, b_scale_e, out_e in _expert_operands(a, a_scale, b, b_scale, ends, out):
        if rows:
            torch._scaled_mm(a_e, b_e, a_scale_e, b_scale_e, out_dtype=out_dtype, use_fast_accum=True, out=out_e)
    return out


def _expert_operands(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor, b_scale: torch.Tensor | None,
                     ends: torch.Tensor, out: torch.Tensor) -> Iterator[tuple[int, ...]]:
    """:func:`per_expert_mm`'s ``(rows, a_e, b_e, a_scale_e, b_scale_e, out_e)`` for every expert: views made in a
    few calls (the host's time per GEMM counts: ``benchmarks/fp8_gemm_host_time.py``). Without ``a_scale`` (the
    unscaled product) both scales are one unit scalar, which makes the GEMMs tensorwise; without ``b_scale`` alone,
    one row of ones."""
    sizes = _group_sizes(ends)
    if a_scale is None:
        a_scales = b_scales = itertools.repeat(torch.ones((), device=a.device))
    else:
        a_scales = a_scale[:, None].split(sizes)
        b_scales = (itertools.repeat(a_scale.new_ones(1, b.shape[2])) if b_scale is None
                    else b_scale[:, None, :].unbind(0))
    return zip(sizes, a.split(sizes), b.unbind(0), a_scales, b_scales, out.split(sizes))


@per_expert_mm.register_fake
def _(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor, b_scale: torch.Tensor | None, ends: torch.Tensor,
      out_dtype: torch.dtype) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype)


@torch.library.custom_op("megatron_core::fp8_per_expert_wgrad_mm", mutates_args=(), **_HOST_READ_TAGS)
def per_expert_wgrad_mm(a_t: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor,
                        ends: torch.Tensor, out_dtype: torch.dtype, k_align: int = 1) -> torch.Tensor:
    """``stack_e(a_e.T @ b_e)`` (the weight gradient ``dW_e = dy_e.T @ x_e``) with one ``torch._scaled_mm`` per expert.

    ``a_t [P, L]`` and ``b_t [Q, L]``: e4m3 codes of ``a = dy`` and ``b = x`` transposed (row-major), each expert's
    rows of ``a`` and ``b`` a range of their columns: the expert's row count (from ``ends [E]``, the experts' end
    rows, read to the host here unless already there) rounded up to a multiple of ``k_align``, the columns past its
    rows zeros (``megatron_core.fp8.scaled_grouped_mm.aligned_contraction_layout``); ``a_scale [E * P]`` and
    ``b_scale [E * Q]``: the dequantizing scales, one per column of ``a`` / ``b`` within each expert's rows
    (expert-major). Returns ``[E, P, Q]`` in ``out_dtype``; an expert without rows gets zeros.
    """
    _refuse_capture("fp8_per_expert_wgrad_mm", a_t)
    if k_align < 1:
        raise ValueError(f"fp8_per_expert_wgrad_mm: k_align must be a positive number of tokens, got {k_align}")
    experts = ends.numel()
    out = a_t.new_empty(experts, a_t.shape[0], b_t.shape[0], dtype=out_dtype)
    sizes = [-(-rows // k_align) * k_align for rows in _group_sizes(ends)]
    used = sum(sizes)
    operands = zip(sizes, a_t[:, :used].split(sizes, dim=1), b_t[:, :used].t().split(sizes),
                   a_scale.view(experts, -1, 1).unbind(0), b_scale.view(experts, 1, -1).unbind(0), out.unbind(0))
    for rows, a_e, b_e, a_scale_e, b_scale_e, out_e in operands:
        if rows:
            torch._scaled_mm(a_e, b_e, a_scale_e, b_scale_e, out_dtype=out_dtype, use_fast_accum=True, out=out_e)
        else:
            out_e.zero_()
    return out


@per_expert_wgrad_mm.register_fake
def _(a_t: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor, ends: torch.Tensor,
      out_dtype: torch.dtype, k_align: int = 1) -> torch.Tensor:
    return a_t.new_empty(ends.shape[0], a_t.shape[0], b_t.shape[0], dtype=out_dtype)
