"""Communication for tensor and sequence parallelism: the only module here that calls ``torch.distributed``.

The public functions are Megatron-Core's "mappings": autograd functions whose backward is the
conjugate collective of their forward (identity <-> all-reduce, split <-> all-gather,
all-gather <-> reduce-scatter). Layouts: "last dim" functions act on the hidden dimension,
"sequence parallel region" functions act on the first dimension of ``[s, b, h]`` activations.
Every function takes ``group=None``, meaning the tensor-parallel group of ``parallel_state``.

The underscore helpers at the top are plain (non-autograd) collectives that the other modules
of this subpackage (layers, cross entropy, data broadcast, recompute) call. Collectives never
modify their input: outputs are new tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.tensor_parallel.groups import resolve_tp_group

# torch 2.13 renamed the single-tensor collectives; older releases only have the former names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, else the TP group of the package resolver (``None``: no TP)."""
    return resolve_tp_group(group)


# --- plain collectives -------------------------------------------------------------------------
def _all_reduce(input_: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce into a new tensor (the input is left unchanged)."""
    if get_pg_size(group) == 1:
        return input_
    output = input_.contiguous().clone()
    dist.all_reduce(output, op=op, group=group)
    return output


def _all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``tensor`` in place (for buffers this package owns) and return it."""
    if get_pg_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _broadcast_(tensor: torch.Tensor, group: dist.ProcessGroup | None, group_src: int = 0) -> torch.Tensor:
    """Broadcast ``tensor`` in place from rank ``group_src`` of ``group``."""
    if get_pg_size(group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(group, group_src), group=group)
    return tensor


def _split_along_dim(input_: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's equal slice of ``input_`` along ``dim``."""
    world_size = get_pg_size(group)
    if world_size == 1:
        return input_
    size = input_.size(dim)
    if size % world_size != 0:
        raise ValueError(
            f"dimension {dim} of a tensor of shape {tuple(input_.shape)} ({size}) is not divisible by "
            f"the tensor-parallel size ({world_size})"
        )
    return input_.chunk(world_size, dim=dim)[get_pg_rank(group)].contiguous()


def _gather_along_first_dim(
    input_: torch.Tensor, group: dist.ProcessGroup | None, output_split_sizes: list[int] | None = None
) -> torch.Tensor:
    """Concatenate every rank's ``input_`` along dim 0 (uneven pieces when ``output_split_sizes``)."""
    world_size = get_pg_size(group)
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    if output_split_sizes is None:
        output = torch.empty((world_size * input_.size(0),) + tuple(input_.shape[1:]),
                             dtype=input_.dtype, device=input_.device)
        _all_gather_single(output, input_, group=group)
        return output
    largest = max(output_split_sizes)
    padded = input_.new_zeros((largest,) + tuple(input_.shape[1:]))
    padded[: input_.size(0)] = input_
    gathered = _gather_along_first_dim(padded, group)
    pieces = gathered.split(largest, dim=0)
    return torch.cat([piece[:n] for piece, n in zip(pieces, output_split_sizes)], dim=0)


def _gather_along_last_dim(input_: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``input_`` along the last dimension."""
    world_size = get_pg_size(group)
    if world_size == 1:
        return input_
    # Moving the last dim to the front makes the concatenation a plain dim-0 all-gather.
    gathered = _gather_along_first_dim(input_.movedim(-1, 0), group)
    return gathered.movedim(0, -1).contiguous()


def _reduce_scatter_along_first_dim(
    input_: torch.Tensor, group: dist.ProcessGroup | None, input_split_sizes: list[int] | None = None
) -> torch.Tensor:
    """Sum over ranks, then keep this rank's slice along dim 0 (uneven when ``input_split_sizes``)."""
    world_size = get_pg_size(group)
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    if input_split_sizes is not None:
        total = _all_reduce(input_, group)
        return total.split(input_split_sizes, dim=0)[get_pg_rank(group)].contiguous()
    if input_.size(0) % world_size != 0:
        raise ValueError(
            f"first dimension of a tensor of shape {tuple(input_.shape)} ({input_.size(0)}) is not "
            f"divisible by the tensor-parallel size ({world_size})"
        )
    output = torch.empty((input_.size(0) // world_size,) + tuple(input_.shape[1:]),
                         dtype=input_.dtype, device=input_.device)
    _reduce_scatter_single(output, input_, group=group)
    return output


def _reduce_scatter_along_last_dim(input_: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over ranks, then keep this rank's slice of the last dimension."""
    if get_pg_size(group) == 1:
        return input_
    return _reduce_scatter_along_first_dim(input_.movedim(-1, 0), group).movedim(0, -1).contiguous()


def _all_to_all_single(
    input_: torch.Tensor,
    group: dist.ProcessGroup | None,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """Exchange slices of dim 0: piece ``i`` of ``input_`` goes to rank ``i``."""
    world_size = get_pg_size(group)
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    if output_split_sizes is None:
        output = torch.empty_like(input_)
    else:
        output = input_.new_empty((sum(output_split_sizes),) + tuple(input_.shape[1:]))
    dist.all_to_all_single(output, input_, output_split_sizes=output_split_sizes,
                           input_split_sizes=input_split_sizes, group=group)
    return output


# --- autograd mappings -------------------------------------------------------------------------
class _CopyToModelParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _all_reduce(grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """Forward: all-reduce. Backward: identity."""

    @staticmethod
    def forward(ctx, input_, group):
        return _all_reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_dim(input_, -1, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_dim(grad_output, -1, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of dim 0. Backward: all-gather dim 0."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_dim(input_, 0, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather dim 0. Backward: reduce-scatter dim 0, or split when the grad is replicated."""

    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad, group, output_split_sizes):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.output_split_sizes = output_split_sizes
        return _gather_along_first_dim(input_, group, output_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            grad = _reduce_scatter_along_first_dim(grad_output, ctx.group, ctx.output_split_sizes)
        elif ctx.output_split_sizes is not None:
            grad = grad_output.split(ctx.output_split_sizes, dim=0)[get_pg_rank(ctx.group)].contiguous()
        else:
            grad = _split_along_dim(grad_output, 0, ctx.group)
        return grad, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter dim 0. Backward: all-gather dim 0."""

    @staticmethod
    def forward(ctx, input_, group, input_split_sizes):
        ctx.group = group
        ctx.input_split_sizes = input_split_sizes
        return _reduce_scatter_along_first_dim(input_, group, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group, ctx.input_split_sizes), None, None


class _AllGatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: reduce-scatter the last dim."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce_scatter_along_last_dim(grad_output, ctx.group), None


class _ReduceScatterToTensorParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all over dim 0. Backward: the inverse all-to-all (split sizes swapped)."""

    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        return _all_to_all_single(input_, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        grad = _all_to_all_single(grad_output, ctx.group, ctx.input_split_sizes, ctx.output_split_sizes)
        return None, grad, None, None


# --- public API --------------------------------------------------------------------------------
def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Identity in forward; all-reduce of the gradient over the TP group in backward."""
    group = _group(group)
    if get_pg_size(group) == 1:
        return input_
    return _CopyToModelParallelRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) over the TP group in forward; identity in backward."""
    group = _group(group)
    if get_pg_size(group) == 1:
        return input_
    return _ReduceFromModelParallelRegion.apply(input_, group)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dim; backward all-gathers the gradient."""
    return _ScatterToModelParallelRegion.apply(input_, _group(group))


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather the last dim over the TP group; backward keeps this rank's slice."""
    return _GatherFromModelParallelRegion.apply(input_, _group(group))


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the sequence (first) dim; backward all-gathers it."""
    return _ScatterToSequenceParallelRegion.apply(input_, _group(group))


def gather_from_sequence_parallel_region(
    input_: torch.Tensor,
    tensor_parallel_output_grad: bool = True,
    group=None,
    output_split_sizes: list[int] | None = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """All-gather the sequence (first) dim over the TP group.

    Backward reduce-scatters the gradient, or (``tensor_parallel_output_grad=False``, when the
    consumer's gradient is already replicated across TP) keeps this rank's slice.
    ``use_global_buffer`` is accepted for compatibility; the output is always a new tensor.
    """
    return _GatherFromSequenceParallelRegion.apply(
        input_, tensor_parallel_output_grad, _group(group), output_split_sizes
    )


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor, group=None, input_split_sizes: list[int] | None = None, use_global_buffer: bool = False
) -> torch.Tensor:
    """Sum over the TP group and keep this rank's slice of the sequence dim; backward all-gathers."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_, _group(group), input_split_sizes)


def all_gather_last_dim_from_tensor_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather the last dim; backward reduce-scatters the last dim."""
    return _AllGatherFromTensorParallelRegion.apply(input_, _group(group))


def reduce_scatter_last_dim_to_tensor_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter the last dim; backward all-gathers the last dim."""
    return _ReduceScatterToTensorParallelRegion.apply(input_, _group(group))


def all_to_all(
    group,
    input_: torch.Tensor,
    output_split_sizes_: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """All-to-all over dim 0 of ``input_`` (``group`` first, as in Megatron-Core); backward inverts it."""
    return _AllToAll.apply(_group(group), input_, output_split_sizes_, input_split_sizes)


def all_to_all_sp2hp(input_: torch.Tensor, group=None) -> torch.Tensor:
    """``[num_tokens / TP, H]`` sequence-sharded -> ``[num_tokens, H / TP]`` hidden-sharded."""
    group = _group(group)
    world_size = get_pg_size(group)
    if world_size == 1:
        return input_
    hidden = input_.size(-1)
    input_ = input_.reshape(-1, hidden)
    # Chunk i of the hidden dim goes to rank i; stacking along dim 0 makes that an all-to-all over dim 0.
    send = torch.cat(input_.chunk(world_size, dim=1), dim=0)
    return all_to_all(group, send)


def all_to_all_hp2sp(input_: torch.Tensor, group=None) -> torch.Tensor:
    """``[num_tokens, H / TP]`` hidden-sharded -> ``[num_tokens / TP, H]`` sequence-sharded."""
    group = _group(group)
    world_size = get_pg_size(group)
    if world_size == 1:
        return input_
    hidden_part = input_.size(-1)
    input_ = input_.reshape(-1, hidden_part)
    received = all_to_all(group, input_)
    return torch.cat(received.chunk(world_size, dim=0), dim=1)
