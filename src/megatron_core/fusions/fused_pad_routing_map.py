"""Padding each expert's routed-token count to a multiple (Megatron-Core's ``fused_pad_routing_map``).

FP8 / FP4 grouped GEMMs want every expert's rows in multiples of 16 or 32. With
``moe_router_padding_for_quantization`` the dispatcher adds zero-probability routes instead of padding the
rows: each expert gains the earliest tokens not yet routed to it until its count is a multiple of
``pad_multiple`` (the result of ``moe_utils.pad_routing_map``). Megatron-Core uses this function when
``moe_permute_fusion`` and its experimental features are on.

On CUDA with Triton one program per expert runs ``_pad_routing_map_kernel`` (two passes over the expert's
column: the count, then the flips, any number of tokens); elsewhere the same scan in PyTorch ops. As in
Megatron-Core the result is ``int32`` ``[num_tokens, num_experts]`` (a transposed view of an
``[num_experts, num_tokens]`` buffer), 1 where a token is routed or padded; nonzero entries of the input count as
routed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, triton_modules, triton_op

__all__ = ["fused_pad_routing_map"]

_BLOCK = 1024  # tokens per step of an expert's loop


def _kernel_serves(t: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for ``t`` (CUDA, Triton installed, a torch with ``triton_op``)."""
    return t.is_cuda and _OP is not None and have_triton()


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()

    @triton.jit
    def _pad_routing_map_kernel(map_ptr, out_ptr, tokens, stride_token, stride_expert, pad_multiple,
                                BLOCK: tl.constexpr):
        expert = tl.program_id(0).to(tl.int64)
        column = map_ptr + expert * stride_expert
        counts = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, tokens, BLOCK):
            t = start + tl.arange(0, BLOCK)
            counts += (tl.load(column + t.to(tl.int64) * stride_token, mask=t < tokens, other=0) != 0).to(tl.int32)
        routed_count = tl.sum(counts, 0)
        missing = (pad_multiple - routed_count % pad_multiple) % pad_multiple
        free_before = tl.zeros([BLOCK], dtype=tl.int32)  # the same value in every lane: free tokens so far
        for start in range(0, tokens, BLOCK):
            t = start + tl.arange(0, BLOCK)
            live = t < tokens
            routed = tl.load(column + t.to(tl.int64) * stride_token, mask=live, other=0) != 0
            free = (live & (routed == 0)).to(tl.int32)
            rank = free_before + tl.cumsum(free, 0)  # 1-based rank of each free token in the whole column
            padded = routed | ((free != 0) & (rank <= missing))
            tl.store(out_ptr + expert * tokens + t, padded.to(tl.int32), mask=live)
            free_before += tl.sum(free, 0)

    return _pad_routing_map_kernel


def _pad_kernel(routing_map: torch.Tensor, pad_multiple: int) -> torch.Tensor:
    tokens, experts = routing_map.shape
    out = torch.empty(experts, tokens, dtype=torch.int32, device=routing_map.device)
    if experts:
        torch.library.wrap_triton(_kernel())[(experts,)](
            routing_map, out, tokens, routing_map.stride(0), routing_map.stride(1), pad_multiple, BLOCK=_BLOCK,
            num_warps=4,
        )
    return out


# Registered at import where Triton is installed (the kernel is built on its first launch).
_OP = triton_op("megatron_core::pad_routing_map", _pad_kernel)


def _pad_torch(routing_map: torch.Tensor, pad_multiple: int) -> torch.Tensor:
    routed = routing_map.t() != 0  # [experts, tokens]: the scan runs along the tokens
    free = ~routed
    missing = (-routed.sum(dim=1)) % pad_multiple
    rank = torch.cumsum(free.to(torch.int32), dim=1)
    return (routed | (free & (rank <= missing.unsqueeze(1)))).to(torch.int32).contiguous()


# Eager inside compiled code, as moe_utils.pad_routing_map: Inductor cannot generate the scan-and-mask kernel, and
# the dispatcher reads the padded counts on the host right after.
@torch.compiler.disable
def fused_pad_routing_map(routing_map: torch.Tensor, pad_multiple: int) -> torch.Tensor:
    """``routing_map [num_tokens, num_experts]`` with routes added so that each expert's count is a multiple of
    ``pad_multiple``: each expert gains its earliest unrouted tokens. Returns ``int32`` (1 routed or padded, 0
    not); the input is not modified, and returned as it is when it has no tokens.
    """
    if routing_map.dim() != 2:
        raise ValueError(f"fused_pad_routing_map: routing_map must be [num_tokens, num_experts], got shape "
                         f"{tuple(routing_map.shape)}")
    if isinstance(pad_multiple, bool) or not isinstance(pad_multiple, int) or pad_multiple < 1:
        raise ValueError(f"fused_pad_routing_map: pad_multiple ({pad_multiple!r}) must be an integer >= 1")
    if routing_map.shape[0] == 0:
        return routing_map
    if _kernel_serves(routing_map):
        padded = _OP(routing_map, pad_multiple)
    else:
        padded = _pad_torch(routing_map, pad_multiple)
    return padded.t()
