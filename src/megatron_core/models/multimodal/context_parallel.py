"""Sequence- and context-parallel helpers of multimodal models (``megatron.core.models.multimodal.context_parallel``).

A LLaVA sample is text plus image embeddings, so its combined length is rarely a multiple of what
sequence parallelism (``tp``) or context parallelism (``2 * cp``, load-balanced chunks) needs.
:func:`get_padding` says how many tokens to add, :func:`get_packed_seq_params` describes the padded
batch to attention, and :func:`split_to_context_parallel_ranks` /
:func:`gather_from_context_parallel_ranks` share a batch of images out over the CP ranks and back
(the gather's backward sums the gradient over the ranks and keeps this rank's part).
The dynamic-resolution helpers (``split_to_context_parallel_ranks_dynamic_res`` /
``gather_from_context_parallel_ranks_dynamic_res``) live in :mod:`.dynamic_res_context_parallel`.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.models.multimodal.dynamic_res_context_parallel import (
    gather_from_context_parallel_ranks_dynamic_res,
    split_to_context_parallel_ranks_dynamic_res,
)
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.tensor_parallel.mappings import _gather_along_first_dim, _reduce_scatter_along_first_dim

__all__ = [
    "GatherFromContextParallelRanks",
    "gather_from_context_parallel_ranks",
    "gather_from_context_parallel_ranks_dynamic_res",
    "get_packed_seq_params",
    "get_padding",
    "split_to_context_parallel_ranks",
    "split_to_context_parallel_ranks_dynamic_res",
]


def get_padding(
    seq_len: int,
    cp_size: int,
    tp_size: int,
    has_sp: bool,
    decoder_tp_comm_overlap: bool = False,
    decoder_seq_len: int | None = None,
    fp8_enabled: bool = False,
    fp8_recipe: str | None = None,
) -> int:
    """Tokens to append to a combined sequence of ``seq_len`` so that SP / CP / FP8 can split it evenly.

    The multiple is ``tp * cp * 2`` with SP and CP, ``cp * 2`` with CP, ``tp`` with SP, else 16 with FP8
    (32 for the ``"mxfp8"`` recipe), else 1. With SP and TP communication overlap the sequence must be
    exactly ``decoder_seq_len`` long, so the padding is ``decoder_seq_len - seq_len``.
    """
    if has_sp and decoder_tp_comm_overlap:
        if decoder_seq_len is None:
            raise ValueError("get_padding: decoder_seq_len is required with has_sp=True and "
                             "decoder_tp_comm_overlap=True (the sequence is padded to exactly that length)")
        if decoder_seq_len < seq_len:
            raise ValueError(f"get_padding: seq_len ({seq_len}) exceeds decoder_seq_len ({decoder_seq_len})")
        return decoder_seq_len - seq_len
    if has_sp and cp_size > 1:
        multiple = tp_size * cp_size * 2
    elif cp_size > 1:
        multiple = cp_size * 2
    elif has_sp:
        multiple = tp_size
    elif fp8_enabled:
        multiple = 32 if fp8_recipe == "mxfp8" else 16
    else:
        multiple = 1
    return int(-seq_len % multiple)


def get_packed_seq_params(
    tokens: torch.Tensor, img_seq_len: int, padding_needed: int, cp_size: int, use_packed_sequence: bool = False
) -> PackedSeqParams:
    """Describe a batch of ``[b, s]`` ``tokens`` whose samples each gain ``img_seq_len`` image positions.

    Every sample is one document of ``s + img_seq_len - padding_needed`` real tokens. With CP and padding
    (or packing) the padded extent ``s + img_seq_len`` is given too and the format is ``"thd"``; otherwise
    ``"sbhd"``.
    """
    batch, text_len = tokens.shape
    padded_len = text_len + img_seq_len
    valid_len = padded_len - padding_needed
    if valid_len <= 0:
        raise ValueError(f"get_packed_seq_params: padding_needed ({padding_needed}) leaves no tokens of the "
                         f"combined length {padded_len} (text {text_len} + image {img_seq_len})")

    def cumulative(step: int) -> torch.Tensor:
        return torch.arange(0, (batch + 1) * step, step, dtype=torch.int32, device=tokens.device)

    cu_seqlens = cumulative(valid_len)
    cu_padded, qkv_format = None, "sbhd"
    if cp_size > 1 and (padding_needed > 0 or use_packed_sequence):
        cu_padded, qkv_format = cumulative(padded_len), "thd"
    return PackedSeqParams(
        cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=padded_len, max_seqlen_kv=padded_len, qkv_format=qkv_format,
    )


def split_to_context_parallel_ranks(global_t: torch.Tensor, pad_value: Any = 0,
                                    cp_group: Any = None) -> tuple[torch.Tensor, int]:
    """This CP rank's contiguous share of ``global_t`` ``[n, ...]`` and the padding added over all ranks.

    Each rank gets ``ceil(n / cp)`` samples; the last ranks are filled up with ``pad_value``.
    """
    group = resolve_process_group("cp", group=cp_group)
    cp_size, cp_rank = get_pg_size(group), get_pg_rank(group)
    per_rank = -(-global_t.shape[0] // cp_size)
    local_t = global_t[cp_rank * per_rank:(cp_rank + 1) * per_rank]
    global_pad = per_rank * cp_size - global_t.shape[0]
    missing = per_rank - local_t.shape[0]
    if missing > 0:
        filler = torch.full((missing, *local_t.shape[1:]), pad_value, dtype=local_t.dtype, device=local_t.device)
        local_t = torch.cat([local_t, filler], dim=0)
    return local_t, global_pad


class GatherFromContextParallelRanks(torch.autograd.Function):
    """All-gather along dimension 1 over the CP group; the backward reduce-scatters along dimension 1."""

    @staticmethod
    def forward(ctx: Any, input_: torch.Tensor, cp_group: Any = None) -> torch.Tensor:
        """Concatenate every CP rank's ``input_`` along dimension 1."""
        ctx.group = resolve_process_group("cp", group=cp_group)
        if get_pg_size(ctx.group) == 1:
            return input_
        return _gather_along_first_dim(input_.movedim(1, 0), ctx.group).movedim(0, 1).contiguous()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Sum the gradient over the CP ranks and keep this rank's slice of dimension 1."""
        if get_pg_size(ctx.group) == 1:
            return grad_output, None
        grad = _reduce_scatter_along_first_dim(grad_output.movedim(1, 0), ctx.group)
        return grad.movedim(0, 1).contiguous(), None


def gather_from_context_parallel_ranks(local_t: torch.Tensor, global_pad: int, cp_group: Any = None) -> torch.Tensor:
    """Undo :func:`split_to_context_parallel_ranks` along dimension 1 and drop the ``global_pad`` filler.

    ``local_t`` is ``[s, n_local, h]`` (samples on dimension 1, as the vision projection's output).
    """
    global_t = GatherFromContextParallelRanks.apply(local_t, cp_group)
    return global_t[:, :global_t.shape[1] - global_pad] if global_pad > 0 else global_t
