"""Expert linear layers for all local experts at once, computed with one grouped GEMM.

``ColumnParallelGroupedLinear`` / ``RowParallelGroupedLinear`` hold one 3-D parameter
``weight [num_local_experts, out, in]`` sharded over the expert tensor-parallel group (fc1 along
``out``, fc2 along ``in``) and never communicate (the token dispatcher does). In the state dict the
weight appears per expert as ``weight0 .. weight{E-1}`` (and ``bias0 ..``), the keys of
Transformer Engine's ``GroupedLinear`` that Megatron-Core's ``TEGroupedMLP`` uses.

:func:`grouped_gemm` runs ``x [N, in]`` split by ``tokens_per_expert`` against the experts'
weights: when every expert has the same number of rows (``moe_pad_expert_input_to_capacity``), as one batched
matmul (``torch.bmm``, which on an H100 runs these GEMMs 4-15% faster than the grouped kernel); otherwise on CUDA,
in bf16/fp16 with 16-byte-aligned shapes and a torch that has it, with ``torch.nn.functional.grouped_mm`` (one
kernel; or, opted into with ``MEGATRON_CORE_MOE_GROUPED_GEMM=cutlass`` on Hopper, :mod:`.cutlass_grouped_gemm`'s);
elsewhere with one matmul per expert. The kernel's
weight-gradient GEMM contracts over each expert's rows, whose count must then be a multiple of
``GROUPED_MM_ROW_ALIGN``: :func:`pad_expert_rows` pads the groups with zero rows (callers that pad once
per layer, as ``TEGroupedMLP`` does, pass aligned counts and nothing more is copied).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core._ground import get_pg_size
from megatron_core.device import get_current_device
from megatron_core.tensor_parallel.delayed_wgrad import DelayedWgradMixin, split_weight_gradient
from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.transformer.moe.cutlass_grouped_gemm import (
    cutlass_grouped_gemm_requested,
    cutlass_grouped_linear,
)
from megatron_core.transformer.moe.host_counts import counts_to_host
from megatron_core.transformer.moe.token_permutation import AlignedRows, aligned_group_starts

__all__ = ["AlignedExpertRows", "ColumnParallelGroupedLinear", "RowParallelGroupedLinear", "align_expert_rows",
           "grouped_gemm", "unpad_expert_rows"]

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _use_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if _GROUPED_MM is None or x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    elems = 16 // x.element_size()
    return weight.shape[1] % elems == 0 and weight.shape[2] % elems == 0


GROUPED_MM_ROW_ALIGN = 16


def use_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`grouped_gemm` runs ``x`` against ``weight`` with the grouped-GEMM kernel."""
    return _use_grouped_mm(x, weight)


def _to_device_without_sync(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: through pinned memory on CUDA, so the copy does not wait for the GPU's
    queue to drain. Inside a compiled graph (where ``pin_memory`` cannot be traced) a plain copy."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def pad_expert_rows(x: torch.Tensor, tokens_per_expert: list[int]
                    ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """``(x padded so every group has a multiple of GROUPED_MM_ROW_ALIGN rows, padded counts, row index)``.

    ``row index`` (``None`` when nothing was padded) gives each original row's place in the padded
    tensor: :func:`unpad_expert_rows` undoes the padding.
    """
    align = GROUPED_MM_ROW_ALIGN
    padded = [-(-c // align) * align for c in tokens_per_expert]
    if padded == list(tokens_per_expert):
        return x, padded, None
    starts = itertools.accumulate([0] + padded[:-1])
    rows = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, tokens_per_expert)])
    index = _to_device_without_sync(rows, x.device)
    out = x.new_zeros((sum(padded),) + tuple(x.shape[1:])).index_copy(0, index, x)
    return out, padded, index


@dataclasses.dataclass(frozen=True)
class AlignedExpertRows(AlignedRows):
    """:class:`AlignedRows` plus ``index [N]``: each original row's place in the padded buffer."""

    index: torch.Tensor


def align_expert_rows(tokens_per_expert: torch.Tensor, num_rows: int) -> AlignedExpertRows:
    """The aligned layout of ``num_rows`` rows grouped by expert, computed without a device-to-host sync.

    ``tokens_per_expert`` is a device tensor summing to ``num_rows``. The buffer has a static size of
    ``num_rows + E * (GROUPED_MM_ROW_ALIGN - 1)`` rounded up to the alignment, so shapes never depend on
    the routing; the slack (zero rows) is appended to the last group, where it adds nothing to any result.
    """
    counts = tokens_per_expert.to(torch.int64)
    num_experts = counts.numel()
    padded_starts, layout = aligned_group_starts(counts, num_rows, GROUPED_MM_ROW_ALIGN)
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts, device=counts.device), counts,
                                            output_size=num_rows)
    starts = torch.cumsum(counts, 0) - counts
    index = torch.arange(num_rows, device=counts.device) - starts[expert_of_row] + padded_starts[expert_of_row]
    return AlignedExpertRows(layout.counts, layout.ends, layout.total_rows, index)


def equal_groups(tokens_per_expert: list[int] | AlignedRows) -> bool:
    """Whether the groups are host-known and all of one non-zero size (each expert padded to its capacity)."""
    if isinstance(tokens_per_expert, AlignedRows) or not tokens_per_expert:
        return False
    return tokens_per_expert[0] > 0 and all(c == tokens_per_expert[0] for c in tokens_per_expert)


class _BatchedExpertLinear(torch.autograd.Function):
    """``x [E, c, in] @ weight[e].T`` for every expert as one ``bmm``, its weight gradient in ``weight``'s layout.

    Autograd's own backward of ``bmm(x, weight.transpose(1, 2))`` would produce the weight gradient as an
    ``[E, in, out]`` tensor seen transposed, which ``.grad`` accumulation then copies into the parameter's layout.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.bmm(x, weight.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight = torch.bmm(grad.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


def group_counts_tensor(tokens_per_expert: list[int] | AlignedRows, device: torch.device) -> torch.Tensor:
    """The group sizes as a tensor on ``device`` (for ``repeat_interleave`` of per-expert biases)."""
    if isinstance(tokens_per_expert, AlignedRows):
        return tokens_per_expert.counts
    return torch.tensor(tokens_per_expert, device=device)


class _GatherDistinctRows(torch.autograd.Function):
    """``x[index]`` for an ``index`` without repeats (dropping the padding rows of an aligned layout).

    Its backward copies the gradient rows back to their places (``index_copy`` into zeros) instead of
    ``index_select``'s scatter-add, which runs on atomics on a GPU.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.num_rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.new_zeros((ctx.num_rows, *grad.shape[1:])).index_copy(0, index, grad), None


def unpad_expert_rows(padded: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows of ``padded`` at ``index`` (each original row's place in an aligned layout), in order."""
    return _GatherDistinctRows.apply(padded, index)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    ``grouped_mm``'s backward rejects a gradient with zero strides, which autograd produces for an
    output that is only summed or broadcast downstream.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_mm_kernel(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``cat_e(x_e @ weight[e].T)`` for the groups ending at the device offsets ``offs``: PyTorch's grouped GEMM,
    or the CUTLASS one when ``MEGATRON_CORE_MOE_GROUPED_GEMM=cutlass`` (:mod:`.cutlass_grouped_gemm`)."""
    if cutlass_grouped_gemm_requested():
        return cutlass_grouped_linear(x, weight, offs)
    return _ContiguousGrad.apply(_GROUPED_MM(x, weight.transpose(1, 2), offs=offs))


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: list[int] | AlignedRows
                 ) -> torch.Tensor:
    """``cat_e(x_e @ weight[e].T)`` for the row blocks ``x_e`` of sizes ``tokens_per_expert``.

    With :class:`AlignedRows` (``x`` already laid out by it), the group offsets stay on the device.
    """
    if equal_groups(tokens_per_expert) and x.shape[0] == tokens_per_expert[0] * weight.shape[0]:
        rows = tokens_per_expert[0]
        out = _BatchedExpertLinear.apply(x.reshape(weight.shape[0], rows, x.shape[1]), weight)
        return out.view(x.shape[0], weight.shape[1])
    if isinstance(tokens_per_expert, AlignedRows):
        if _use_grouped_mm(x, weight):
            return _grouped_mm_kernel(x, weight, tokens_per_expert.ends)
        tokens_per_expert = counts_to_host(tokens_per_expert.counts, "grouped_gemm's per-expert fallback")
    if _use_grouped_mm(x, weight):
        x, padded, index = pad_expert_rows(x, tokens_per_expert)
        if index is not None:
            return unpad_expert_rows(grouped_gemm(x, weight, padded), index)
        ends = torch.tensor(list(itertools.accumulate(tokens_per_expert)), dtype=torch.int32)
        return _grouped_mm_kernel(x, weight, _to_device_without_sync(ends, x.device))
    pieces = torch.split(x, tokens_per_expert, dim=0)
    return torch.cat([F.linear(piece, weight[e]) for e, piece in enumerate(pieces)], dim=0)


class _GroupedLinear(DelayedWgradMixin, torch.nn.Module):
    """Shared parts of the column- and row-parallel grouped layers; ``tp_dim`` is the local sharded dim."""

    tp_dim = 0

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config: Any, init_method: Callable,
                 bias: bool, skip_bias_add: bool, is_expert: bool = True, tp_comm_buffer_name: str | None = None,
                 tp_group: Any = None, pg_collection: Any = None, name: str | None = None) -> None:
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group, pg_collection, is_expert=True)
        self.num_gemms = num_gemms
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.config = config
        self.name = name
        tp = get_pg_size(self.tp_group)
        sizes = [output_size, input_size]
        if sizes[self.tp_dim] % tp != 0:
            raise ValueError(f"{('output_size', 'input_size')[self.tp_dim]} ({sizes[self.tp_dim]}) must be divisible "
                             f"by the expert tensor-parallel size ({tp})")
        sizes[self.tp_dim] //= tp
        device = torch.device("cpu") if config.use_cpu_initialization else get_current_device()
        self.weight = torch.nn.Parameter(torch.empty(num_gemms, *sizes, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            with torch.no_grad():
                for e in range(num_gemms):
                    init_method(self.weight[e])
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = self.tp_dim + 1
        self.weight.partition_stride = 1
        self.weight.allreduce = False
        if bias:
            bias_size = sizes[0] if self.tp_dim == 0 else output_size
            self.bias = torch.nn.Parameter(torch.zeros(num_gemms, bias_size, dtype=config.params_dtype, device=device))
            self.bias.tensor_model_parallel = self.tp_dim == 0
            self.bias.partition_dim = 1
            self.bias.allreduce = False
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int] | AlignedRows
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output [N, out_local], bias [E, out_local] when skip_bias_add else None)``."""
        if self.delay_wgrad_compute and self.weight.requires_grad and torch.is_grad_enabled():
            output = split_weight_gradient(lambda x_, w_: grouped_gemm(x_, w_, tokens_per_expert), self, x,
                                           self.weight)
        else:
            output = self.gemm(x, tokens_per_expert)
        if self.bias is None:
            return output, None
        if self.skip_bias_add:
            return output, self.bias
        counts = group_counts_tensor(tokens_per_expert, x.device)
        return output + self.bias.repeat_interleave(counts, dim=0, output_size=x.shape[0]), None

    def gemm(self, x: torch.Tensor, tokens_per_expert: list[int] | AlignedRows) -> torch.Tensor:
        """``cat_e(x_e @ weight[e].T)``: :func:`grouped_gemm` (FP8 subclasses quantize it)."""
        return grouped_gemm(x, self.weight, tokens_per_expert)

    def deferrable(self) -> bool:
        """Whether ``delay_wgrad_compute`` can defer the experts' weight gradient (not with a subclass's own GEMM,
        e.g. FP8)."""
        return type(self).gemm is _GroupedLinear.gemm

    def backward_dw(self) -> None:
        """Run the experts' weight-gradient GEMMs queued by the backward when deferral is on (else nothing)."""
        super().backward_dw()

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        for name in ("weight", "bias"):
            param = getattr(self, name)
            if param is None:
                continue
            for e in range(self.num_gemms):
                value = param[e]
                destination[f"{prefix}{name}{e}"] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        for name in ("weight", "bias"):
            param = getattr(self, name)
            if param is None:
                continue
            for e in range(self.num_gemms):
                key = f"{prefix}{name}{e}"
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                value = state_dict[key]
                if tuple(value.shape) != tuple(param.shape[1:]):
                    error_msgs.append(f"size mismatch for {key}: checkpoint {tuple(value.shape)}, "
                                      f"model {tuple(param.shape[1:])}")
                    continue
                with torch.no_grad():
                    param[e].copy_(value)
        if strict:
            known = {f"{prefix}{n}{e}" for n in ("weight", "bias") for e in range(self.num_gemms)}
            for key in state_dict:
                if key.startswith(prefix) and key not in known and "." not in key[len(prefix):]:
                    unexpected_keys.append(key)

    def extra_repr(self) -> str:
        """Experts, sizes, bias and expert-TP size."""
        return (f"num_gemms={self.num_gemms}, in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, ETP={get_pg_size(self.tp_group)}")


class ColumnParallelGroupedLinear(_GroupedLinear):
    """Experts' fc1: ``weight [E, out / ETP, in]``; the bias is sharded like the output."""

    tp_dim = 0


class RowParallelGroupedLinear(_GroupedLinear):
    """Experts' fc2: ``weight [E, out, in / ETP]``; the output is a partial sum over ETP, the bias is replicated."""

    tp_dim = 1

