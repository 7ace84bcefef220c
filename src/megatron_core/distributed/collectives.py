"""Every collective used by data parallelism and the optimizers, in one place.

Thin wrappers over ``torch.distributed`` that return async work handles when asked and coalesce
many small tensors into one flat buffer. Both gloo (CPU) and NCCL (GPU) support every op used here.

Each takes the process group explicitly. ``None`` is refused: ``torch.distributed`` reads it as
the WORLD group, while the package's resolver returns it for "no group set up". "This process
alone" is spelled :data:`LOCAL` (every collective over it, as over any one-rank group, is the
identity); :func:`local_if_none` turns a resolved group into a collective group, and WORLD is
``torch.distributed.group.WORLD``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.distributed.reduce_scatter_with_fp32_accumulation import (
    reduce_scatter_with_fp32_accumulation,
)

# torch >= 2.13 renames the single-tensor collectives and deprecates the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Local:
    """The group of this process alone: size 1, rank 0; no collective over it communicates."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "collectives.LOCAL"


LOCAL = _Local()
"""This process alone (no parallelism). Not ``None``, which torch reads as WORLD."""


class GroupProduct:
    """Several orthogonal groups that together span a set of ranks, reduced over one after the other.

    The distributed optimizer's gradient statistics live on the DP shards of model-parallel shards:
    summing (or taking the max) over the data-parallel group and then over the model-parallel group
    covers every rank of the model exactly once, with no group of its own to create.
    :func:`all_reduce` accepts it for ``sum`` and ``max``.
    """

    def __init__(self, *groups: Any) -> None:
        if any(g is None for g in groups):
            raise ValueError("GroupProduct needs explicit groups (use LOCAL for this process alone), got None")
        self.groups = tuple(groups)

    def size(self) -> int:
        """Ranks spanned: the product of the groups' sizes."""
        size = 1
        for g in self.groups:
            size *= get_pg_size(g)
        return size

    def rank(self) -> int:
        """This rank's index, the first group varying fastest."""
        rank, stride = 0, 1
        for g in self.groups:
            rank += get_pg_rank(g) * stride
            stride *= get_pg_size(g)
        return rank

    def __repr__(self) -> str:
        return f"GroupProduct{self.groups!r}"


def local_if_none(group: Any) -> Any:
    """``group``, or :data:`LOCAL` where the resolver found no group (``None``)."""
    return LOCAL if group is None else group


group_size = get_pg_size
"""Alias of :func:`megatron_core.utils.get_pg_size`, the package's one group-size helper."""
group_rank = get_pg_rank
"""Alias of :func:`megatron_core.utils.get_pg_rank`, the package's one group-rank helper."""


def _size(group: Any) -> int:
    """Ranks in ``group``, refusing ``None`` (which ``torch.distributed`` would read as WORLD)."""
    if group is None:
        raise ValueError(
            "collectives need an explicit process group, got None (torch.distributed reads None as the WORLD "
            "group): pass the group, collectives.LOCAL for this process alone, or local_if_none(resolved_group)"
        )
    return get_pg_size(group)


def _is_gloo(group: Any) -> bool:
    return dist.get_backend(group) == "gloo"


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


class _CopyOnWait:
    """A work handle that copies a scratch result into its destination once the collective is done."""

    def __init__(self, work: dist.Work | None, scratch: torch.Tensor, destination: torch.Tensor) -> None:
        self._work, self._scratch, self._destination = work, scratch, destination

    def wait(self) -> bool:
        """Wait for the collective, then copy the result into place."""
        if self._work is not None:
            self._work.wait()
        self._destination.copy_(self._scratch)
        return True


def all_reduce(tensor: torch.Tensor, group: Any, op: str = "sum",
               async_op: bool = False) -> dist.Work | None:
    """In-place all-reduce (``op`` in sum, avg, max, min); a no-op on a single rank.

    Over a :class:`GroupProduct` (``sum``, ``max`` or ``min``, synchronous) it reduces over each group in turn.
    """
    if _size(group) == 1:
        return None
    if isinstance(group, GroupProduct):
        if op not in ("sum", "max", "min") or async_op:
            raise ValueError(f"all_reduce over a GroupProduct supports synchronous sum/max/min, got op={op!r}, "
                             f"async_op={async_op}")
        for g in group.groups:
            all_reduce(tensor, g, op)
        return None
    reduce_op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
                 "min": dist.ReduceOp.MIN}[op]
    return dist.all_reduce(tensor, op=reduce_op, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_: torch.Tensor, group: Any,
                   op: str = "sum", async_op: bool = False, fp32_accumulation: bool = False) -> dist.Work | None:
    """Reduce ``input_`` (size ``n * group_size``) across ``group`` and keep this rank's ``n`` elements.

    ``output`` may be a view of ``input_`` (the distributed optimizer writes into its own shard).
    ``fp32_accumulation``: add in fp32 (:func:`.reduce_scatter_with_fp32_accumulation`), for low-precision grads.
    """
    if _size(group) == 1:
        if output.data_ptr() != input_.data_ptr():
            output.copy_(input_)
        return None
    reduce_op = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
    if fp32_accumulation:
        return reduce_scatter_with_fp32_accumulation(output, input_, reduce_op, group, async_op)
    if _is_gloo(group) and _overlaps(output, input_):
        # Gloo may write the output while still reading the input: reduce into scratch, copy on wait.
        scratch = torch.empty_like(output)
        work = _reduce_scatter_single(scratch, input_, op=reduce_op, group=group, async_op=async_op)
        pending = _CopyOnWait(work, scratch, output)
        if async_op:
            return pending
        pending.wait()
        return None
    return _reduce_scatter_single(output, input_, op=reduce_op, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input_: torch.Tensor, group: Any,
               async_op: bool = False) -> dist.Work | None:
    """Gather every rank's ``input_`` into ``output`` (rank order); ``input_`` may be a view of ``output``."""
    if _size(group) == 1:
        if output.data_ptr() != input_.data_ptr():
            output.copy_(input_)
        return None
    if _is_gloo(group) and _overlaps(output, input_):
        # Gloo may overwrite the output before it has read an aliased input: send a copy.
        input_ = input_.clone()
    return _all_gather_single(output, input_, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: Any) -> None:
    """Broadcast ``tensor`` from the rank with index ``src_group_rank`` in ``group``."""
    if _size(group) == 1:
        return
    dist.broadcast(tensor, src=dist.get_global_rank(group, src_group_rank), group=group)


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], group: Any) -> None:
    """Sum-all-reduce many tensors with one collective per dtype, writing the results back in place."""
    if _size(group) == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        for t, reduced in zip(same, _unflatten_dense_tensors(flat, same)):
            t.copy_(reduced)


def all_gather_object(obj: object, group: Any) -> list[object]:
    """Every rank's ``obj`` (picklable) in group-rank order."""
    if _size(group) == 1:
        return [obj]
    out: list[object] = [None] * _size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
