"""Top-k expert indices to a multi-hot routing map and back (Megatron-Core's ``fused_indices_converter``).

A dispatcher that receives each token's top-k slots (DeepEP's ``indices [tokens, topk]``, ``-1`` where a slot
routes to no local expert, and their probabilities) needs the routing map ``[tokens, num_of_local_experts]``
(bool) and the probabilities at the same places. :func:`fused_indices_to_multihot` makes both; its backward
gathers the probabilities' gradient back to the ``[tokens, topk]`` slots.

On CUDA with Triton one kernel runs each way (``_indices_to_multihot_kernel``, ``_multihot_to_indices_kernel``);
elsewhere a scatter / gather in PyTorch ops gives the same values. Slots holding an index outside
``[0, num_of_local_experts)`` are ignored (Megatron-Core ignores ``-1`` and indices past the last expert). An
expert named by two slots of one row gets the sum of their probabilities and both slots its gradient
(Megatron-Core's kernel keeps whichever slot it writes last).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, next_power_of_two, triton_modules, triton_op

__all__ = ["IndicesToMultihot", "fused_indices_to_multihot"]

_ROWS = 16  # tokens per program
_MAX_EXPERT_BLOCK = 128  # expert columns per step of the forward's loop


def _kernels_serve(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for ``t`` (CUDA, Triton installed, a torch with ``triton_op``)."""
    return t.is_cuda and _FORWARD_OP is not None and have_triton()


@functools.cache
def _kernels() -> tuple[Any, Any]:
    triton, tl = triton_modules()

    @triton.jit
    def _indices_to_multihot_kernel(idx_ptr, probs_ptr, map_ptr, out_ptr, tokens, topk, experts,
                                    ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live_rows = rows < tokens
        for start in range(0, experts, BLOCK_E):
            e = start + tl.arange(0, BLOCK_E)
            hits = tl.zeros([ROWS, BLOCK_E], dtype=tl.int32)
            probs = tl.zeros([ROWS, BLOCK_E], dtype=tl.float32)
            for slot in range(0, topk):
                idx = tl.load(idx_ptr + rows * topk + slot, mask=live_rows, other=-1).to(tl.int64)
                p = tl.load(probs_ptr + rows * topk + slot, mask=live_rows, other=0.0).to(tl.float32)
                hit = idx[:, None] == e[None, :]  # -1 matches no column; columns >= experts are not stored
                hits += hit.to(tl.int32)
                probs += tl.where(hit, p[:, None], 0.0)
            offs = rows[:, None] * experts + e[None, :]
            store = live_rows[:, None] & (e < experts)[None, :]
            tl.store(map_ptr + offs, hits > 0, mask=store)
            tl.store(out_ptr + offs, probs.to(out_ptr.dtype.element_ty), mask=store)

    @triton.jit
    def _multihot_to_indices_kernel(grad_ptr, idx_ptr, out_ptr, tokens, topk, experts, stride_grad,
                                    ROWS: tl.constexpr, TOPK: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        slots = tl.arange(0, TOPK)
        live = (rows < tokens)[:, None] & (slots < topk)[None, :]
        offs = rows[:, None] * topk + slots[None, :]
        idx = tl.load(idx_ptr + offs, mask=live, other=-1).to(tl.int64)
        valid = live & (idx >= 0) & (idx < experts)
        g = tl.load(grad_ptr + rows[:, None] * stride_grad + idx, mask=valid, other=0.0)
        tl.store(out_ptr + offs, g.to(out_ptr.dtype.element_ty), mask=live)

    return _indices_to_multihot_kernel, _multihot_to_indices_kernel


def _forward_kernel(indices: torch.Tensor, probs: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, topk = indices.shape
    routing_map = torch.empty(tokens, experts, dtype=torch.bool, device=indices.device)
    multihot_probs = torch.empty(tokens, experts, dtype=probs.dtype, device=indices.device)
    if tokens and experts:
        block_e = min(next_power_of_two(experts), _MAX_EXPERT_BLOCK)
        torch.library.wrap_triton(_kernels()[0])[(-(-tokens // _ROWS),)](
            indices, probs, routing_map, multihot_probs, tokens, topk, experts, ROWS=_ROWS, BLOCK_E=block_e,
            num_warps=4,
        )
    return routing_map, multihot_probs


def _backward_kernel(grad: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    tokens, topk = indices.shape
    out = torch.empty(tokens, topk, dtype=grad.dtype, device=grad.device)
    if tokens and topk:
        torch.library.wrap_triton(_kernels()[1])[(-(-tokens // _ROWS),)](
            grad, indices, out, tokens, topk, grad.shape[1], grad.stride(0), ROWS=_ROWS,
            TOPK=next_power_of_two(topk), num_warps=1,
        )
    return out


# Registered at import where Triton is installed (the kernels are built on their first launch).
_FORWARD_OP = triton_op("megatron_core::indices_to_multihot", _forward_kernel)
_BACKWARD_OP = triton_op("megatron_core::multihot_to_indices", _backward_kernel)


def _valid_columns(indices: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid [tokens, topk], column [tokens, topk] int64)``: invalid slots point at column 0."""
    valid = (indices >= 0) & (indices < experts)
    return valid, torch.where(valid, indices, 0).long()


def _forward_torch(indices: torch.Tensor, probs: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    valid, column = _valid_columns(indices, experts)
    tokens = indices.shape[0]
    routed = torch.zeros(tokens, experts, dtype=torch.int8, device=indices.device)
    routed.scatter_reduce_(1, column, valid.to(torch.int8), reduce="amax")
    multihot_probs = torch.zeros(tokens, experts, dtype=probs.dtype, device=indices.device)
    multihot_probs.scatter_add_(1, column, torch.where(valid, probs, 0))
    return routed.bool(), multihot_probs


def _backward_torch(grad: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    valid, column = _valid_columns(indices, grad.shape[1])
    return torch.where(valid, grad.gather(1, column), 0)


class IndicesToMultihot(torch.autograd.Function):
    """Top-k slots ``(indices, probs) [tokens, topk]`` to ``(routing map, probs) [tokens, num_of_local_experts]``.

    The backward returns the gradient of ``probs_indices`` only (the indices and the routing map have none).
    """

    @staticmethod
    def forward(ctx: Any, indices: torch.Tensor, probs_indices: torch.Tensor, num_of_local_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(multihot_indices [tokens, E] bool, probs_in_multihot [tokens, E] in probs_indices' dtype)``."""
        if indices.dim() != 2 or indices.shape != probs_indices.shape:
            raise ValueError(
                f"fused_indices_to_multihot: indices {tuple(indices.shape)} and probs_indices "
                f"{tuple(probs_indices.shape)} must both be [num_of_tokens, topk]"
            )
        if indices.is_floating_point() or indices.is_complex():
            raise ValueError(f"fused_indices_to_multihot: indices must be integers, got {indices.dtype}")
        if int(num_of_local_experts) < 1:
            raise ValueError(f"fused_indices_to_multihot: num_of_local_experts ({num_of_local_experts}) must be >= 1")
        experts = int(num_of_local_experts)
        if _kernels_serve(indices):
            routing_map, multihot_probs = _FORWARD_OP(indices.contiguous(), probs_indices.contiguous(), experts)
        else:
            routing_map, multihot_probs = _forward_torch(indices, probs_indices, experts)
        ctx.save_for_backward(indices)
        ctx.mark_non_differentiable(routing_map)
        return routing_map, multihot_probs

    @staticmethod
    def backward(ctx: Any, grad_multihot_indices: torch.Tensor | None, grad_probs_in_multihot: torch.Tensor | None
                 ) -> tuple[None, torch.Tensor | None, None]:
        """``(None, grad_probs_indices [tokens, topk], None)``: each slot's expert column of the gradient."""
        (indices,) = ctx.saved_tensors
        if grad_probs_in_multihot is None:
            return None, None, None
        if _kernels_serve(grad_probs_in_multihot):
            grad = grad_probs_in_multihot
            if grad.stride(1) != 1:
                grad = grad.contiguous()
            return None, _BACKWARD_OP(grad, indices.contiguous()), None
        return None, _backward_torch(grad_probs_in_multihot, indices), None


def fused_indices_to_multihot(indices: torch.Tensor, probs_indices: torch.Tensor, num_of_local_experts: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing map ``[tokens, num_of_local_experts]`` (bool) and the probabilities at its places, from top-k
    ``indices`` (``-1``: no local expert) and ``probs_indices`` ``[tokens, topk]``; see :class:`IndicesToMultihot`.
    """
    return IndicesToMultihot.apply(indices, probs_indices, num_of_local_experts)
