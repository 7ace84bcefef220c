"""Grouping tokens by expert and back (Megatron-Core's ``permute`` / ``unpermute`` / ``sort_chunks_by_idxs``).

``permute`` turns ``tokens [T, H]`` and a boolean ``routing_map [T, E]`` into ``[N, H]`` rows
sorted by expert (expert 0's tokens first, each expert's tokens in token order), where ``N`` is
the number of (token, expert) pairs. ``sorted_indices [N]`` holds each row's source token, so
``unpermute`` scatters rows back with a sum (a token routed to k experts receives k rows).
With ``drop_and_pad`` every expert has exactly ``capacity = N / E`` rows (the routing map is
padded to capacity by the router), which keeps shapes static.

When every token has exactly ``k`` rows (top-k routing that drops nothing), :func:`permute_top_k`
and :func:`unpermute_top_k` do the same with gathers only: ``token_rows [T, k]`` lists each token's
rows, so the sum back is a gather plus a sum over ``k``, and the backward of each direction is a
gather through the other map, never a scatter-add (which serialises on atomics on a GPU).
:func:`permute_top_k_aligned` writes the same rows straight into the layout a grouped-GEMM kernel wants
(each expert's group starting at a multiple of ``row_alignment``, zero rows between), so the experts need
no copy of their own into it and back.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["AlignedRows", "permute", "permute_top_k", "permute_top_k_aligned", "sort_chunks_by_idxs",
           "unpermute", "unpermute_top_k"]


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None,
            num_out_tokens: int | None = None, fused: bool = False, drop_and_pad: bool = False,
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(permuted_tokens [N, H], permuted_probs [N] or None, sorted_indices [N])``.

    ``num_out_tokens`` (``N``, when the caller knows it) avoids a device-to-host synchronisation. ``fused``
    (Transformer Engine's kernel in Megatron-Core) gives the same result here.
    """
    flat, sorted_indices = _sorted_rows(routing_map, num_out_tokens, drop_and_pad)
    permuted_probs = probs.T.contiguous().reshape(-1).index_select(0, flat) if probs is not None else None
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def _sorted_rows(routing_map: torch.Tensor, num_out_tokens: int | None, drop_and_pad: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(flat, sorted_indices)``: each row's index into the flattened ``[E, T]`` map, and its token."""
    num_tokens, num_experts = routing_map.shape
    map_t = routing_map.bool().T.contiguous()  # [E, T]
    if drop_and_pad and num_out_tokens is not None:
        capacity = num_out_tokens // num_experts
        rows = map_t.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[:, :capacity]
        sorted_indices = rows.reshape(-1)
        flat = (torch.arange(num_experts, device=rows.device).unsqueeze(-1) * num_tokens + rows).reshape(-1)
    elif num_out_tokens is not None:
        flat, sorted_indices, _, _ = _counted_rows(routing_map, num_out_tokens)
    else:
        flat = map_t.reshape(-1).nonzero(as_tuple=False).squeeze(-1)
        sorted_indices = flat % num_tokens
    return flat, sorted_indices


@dataclasses.dataclass(frozen=True)
class AlignedRows:
    """An expert-major row layout whose groups start at aligned rows, all on the device (no host sync).

    ``counts [E]``: each group's rows, padding included (the last group also holds the slack up to
    ``total_rows``); ``ends [E]`` (int32): the groups' end offsets, as the grouped-GEMM kernel takes them;
    ``total_rows``: the static row count, ``N + E * (alignment - 1)`` rounded up to the alignment; ``host_ends``: a
    host copy of ``ends`` where a consumer that needs one read it once for every GEMM of the layout
    (:meth:`with_host_ends`; FP8 experts with per-expert GEMMs), else ``None``.
    """

    counts: torch.Tensor
    ends: torch.Tensor
    total_rows: int
    host_ends: torch.Tensor | None = dataclasses.field(default=None, kw_only=True)

    def with_host_ends(self, host_ends: torch.Tensor | None) -> AlignedRows:
        """This layout carrying ``host_ends`` (the host copy of ``ends``) for the GEMMs that take it."""
        return dataclasses.replace(self, host_ends=host_ends)


def aligned_group_starts(counts: torch.Tensor, num_rows: int, alignment: int
                         ) -> tuple[torch.Tensor, AlignedRows]:
    """``(start row of each group, the layout)`` for groups of ``counts`` rows (summing to ``num_rows``) padded
    to multiples of ``alignment``."""
    num_groups = counts.numel()
    total_rows = -(-(num_rows + num_groups * (alignment - 1)) // alignment) * alignment
    padded = (counts + alignment - 1) // alignment * alignment
    ends = torch.cumsum(padded, 0)
    ends = torch.cat([ends[:-1], ends.new_full((1,), total_rows)])
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return starts, AlignedRows(ends - starts, ends.to(torch.int32), total_rows)


def _counted_rows(routing_map: torch.Tensor, num_out_tokens: int, row_alignment: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AlignedRows | None]:
    """:func:`_sorted_rows` for a known row count, by counting instead of sorting (no device-to-host sync).

    The routed pair ``(t, e)`` lands on row ``start[e] + (routed tokens of e before t)``: expert-major rows,
    each expert's tokens in token order, the first ``num_out_tokens`` of them kept. Each kept row's entries are
    written once (scatters to distinct rows); pairs past the end and unrouted pairs go to a spare last slot.
    With ``row_alignment`` the groups start at multiples of it instead (:class:`AlignedRows`, all
    ``num_out_tokens`` pairs kept), and the padding rows hold ``flat = E * T`` and ``sorted_indices = T``.
    Returns ``(flat, sorted_indices, rows, layout)`` with ``rows [T, E]`` each pair's row (the row count where
    the pair has none) and ``layout`` None without alignment.
    """
    num_tokens, num_experts = routing_map.shape
    routed = routing_map.bool()
    hits = routed.to(torch.int64)
    routed_before = hits.cumsum(dim=0) - hits  # [T, E]: routed tokens of e before t
    # The counts from the same scan: a separate sum over the tokens fused with the scan made Inductor's code
    # generation fail on CUDA (torch 2.11, "list indices must be integers or slices, not NoneType").
    counts = routed_before[-1] + hits[-1]
    layout = None
    if row_alignment is None:
        starts = counts.cumsum(dim=0) - counts
        num_rows = num_out_tokens
    else:
        starts, layout = aligned_group_starts(counts, num_out_tokens, row_alignment)
        num_rows = layout.total_rows
    rows = starts + routed_before
    rows = torch.where(routed & (rows < num_rows), rows, num_rows)
    token = torch.arange(num_tokens, device=routing_map.device).unsqueeze(-1)
    expert = torch.arange(num_experts, device=routing_map.device)
    fill = num_experts * num_tokens  # what the padding rows of an aligned layout keep
    flat = torch.full((num_rows + 1,), fill, dtype=torch.int64, device=routing_map.device)
    flat = flat.scatter(0, rows.reshape(-1), (expert * num_tokens + token).reshape(-1))[:num_rows]
    sorted_indices = flat % num_tokens if layout is None else torch.where(flat < fill, flat % num_tokens, num_tokens)
    return flat, sorted_indices, rows, layout


def _rows_by_token(rows: torch.Tensor, routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """``[T, k]``: each token's rows in expert order, from :func:`_counted_rows`' ``rows`` (k routed pairs each)."""
    routed = routing_map.bool()
    slot = torch.where(routed, routed.to(torch.int64).cumsum(dim=1) - 1, topk)  # unrouted pairs: a spare column
    by_token = torch.empty(rows.shape[0], topk + 1, dtype=torch.int64, device=rows.device)
    return by_token.scatter(1, slot, rows)[:, :topk]


def _gather_or_zero(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source[index]``, with zero rows where ``index`` is ``len(source)`` (an aligned layout's padding)."""
    valid = index < source.shape[0]
    rows = source.index_select(0, torch.where(valid, index, 0))
    return torch.where(valid.view(-1, *([1] * (rows.dim() - 1))), rows, 0)


class _GatherRows(torch.autograd.Function):
    """``rows = tokens[sorted_indices]`` whose backward sums each token's ``k`` row gradients by a gather.

    ``sorted_indices`` may hold ``T`` for padding rows (zero rows, which no token's sum reads back).
    """

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, sorted_indices: torch.Tensor, token_rows: torch.Tensor,
                padded: bool = False) -> torch.Tensor:
        ctx.save_for_backward(token_rows)
        return _gather_or_zero(tokens, sorted_indices) if padded else tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        (token_rows,) = ctx.saved_tensors
        return _sum_rows(grad_rows, token_rows), None, None, None


class _SumRows(torch.autograd.Function):
    """``out[t] = sum of rows[token_rows[t]]`` whose backward hands every row its token's gradient by a gather."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, sorted_indices: torch.Tensor, token_rows: torch.Tensor,
                padded: bool = False) -> torch.Tensor:
        ctx.save_for_backward(sorted_indices)
        ctx.padded = padded
        return _sum_rows(rows, token_rows)

    @staticmethod
    def backward(ctx, grad_tokens: torch.Tensor):
        (sorted_indices,) = ctx.saved_tensors
        if ctx.padded:  # padding rows get zero gradients
            return _gather_or_zero(grad_tokens, sorted_indices), None, None, None
        return grad_tokens.index_select(0, sorted_indices), None, None, None


def _sum_rows(rows: torch.Tensor, token_rows: torch.Tensor) -> torch.Tensor:
    num_tokens, k = token_rows.shape
    return rows.index_select(0, token_rows.reshape(-1)).view(num_tokens, k, *rows.shape[1:]).sum(dim=1)


def permute_top_k(tokens: torch.Tensor, routing_map: torch.Tensor, topk: int, probs: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """:func:`permute` for a routing map with exactly ``topk`` experts per token (nothing dropped).

    Returns ``(permuted_tokens [T*k, H], permuted_probs or None, sorted_indices [T*k], token_rows [T, k])``;
    the caller guarantees the row counts (no device-to-host check).
    """
    num_tokens = tokens.shape[0]
    flat, sorted_indices, rows, _ = _counted_rows(routing_map, num_tokens * topk)
    token_rows = _rows_by_token(rows, routing_map, topk)  # the inverse of the row order: rows grouped by token
    permuted_probs = probs.T.contiguous().reshape(-1).index_select(0, flat) if probs is not None else None
    return _GatherRows.apply(tokens, sorted_indices, token_rows), permuted_probs, sorted_indices, token_rows


def permute_top_k_aligned(tokens: torch.Tensor, routing_map: torch.Tensor, topk: int, row_alignment: int,
                          probs: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, AlignedRows]:
    """:func:`permute_top_k` into groups that start at multiples of ``row_alignment`` (zero rows between).

    Returns ``(rows [R, H], probs [R] or None, sorted_indices [R], token_rows [T, k], layout)``: padding rows
    are zero, their probs zero and their ``sorted_indices`` ``T``; ``R = layout.total_rows`` is static.
    :func:`unpermute_top_k` sums them back (padding rows get zero gradients).
    """
    flat, sorted_indices, rows, layout = _counted_rows(routing_map, routing_map.shape[0] * topk, row_alignment)
    token_rows = _rows_by_token(rows, routing_map, topk)
    permuted_probs = None
    if probs is not None:
        permuted_probs = _gather_or_zero(probs.T.contiguous().reshape(-1), flat)
    return (_GatherRows.apply(tokens, sorted_indices, token_rows, True), permuted_probs, sorted_indices, token_rows,
            layout)


def unpermute_top_k(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, token_rows: torch.Tensor,
                    ) -> torch.Tensor:
    """:func:`unpermute` (without probs) of :func:`permute_top_k`'s or :func:`permute_top_k_aligned`'s rows:
    ``[T, H]``."""
    padded = permuted_tokens.shape[0] != token_rows.numel()
    return _SumRows.apply(permuted_tokens, sorted_indices, token_rows, padded)


def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, restore_shape: torch.Size,
              probs: torch.Tensor | None = None, routing_map: torch.Tensor | None = None, fused: bool = False,
              drop_and_pad: bool = False) -> torch.Tensor:
    """Sum each row back into its source token: ``[T, H]`` of ``restore_shape``.

    With ``probs`` (``[T, E]``, needs ``routing_map``) each row is first weighted by its probability. ``fused``
    (Transformer Engine's kernel in Megatron-Core) gives the same result here.
    """
    if probs is not None:
        if routing_map is None:
            raise ValueError("unpermute: routing_map is needed to weight rows by probs")
        num_experts = routing_map.shape[1]
        if drop_and_pad:
            capacity = sorted_indices.numel() // num_experts
            rows = sorted_indices.view(num_experts, capacity)
            flat = (torch.arange(num_experts, device=rows.device).unsqueeze(-1) * probs.shape[0] + rows).reshape(-1)
            weights = probs.T.contiguous().reshape(-1).index_select(0, flat)
        else:
            weights = probs.T.contiguous().masked_select(routing_map.T.contiguous())
        permuted_tokens = permuted_tokens * weights.unsqueeze(-1)
    output = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    output.index_add_(0, sorted_indices, permuted_tokens)
    return output


def sort_chunks_by_idxs(input: torch.Tensor, split_sizes: torch.Tensor | list[int], sorted_idxs: torch.Tensor | list[int],
                        probs: torch.Tensor | None = None, fused: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Split ``input`` (and ``probs``) into chunks of ``split_sizes`` and concatenate them in ``sorted_idxs`` order."""
    sizes = split_sizes.tolist() if isinstance(split_sizes, torch.Tensor) else list(split_sizes)
    order = sorted_idxs.tolist() if isinstance(sorted_idxs, torch.Tensor) else list(sorted_idxs)
    chunks = torch.split(input, sizes, dim=0)
    output = torch.cat([chunks[i] for i in order], dim=0)
    if probs is None:
        return output, None
    prob_chunks = torch.split(probs, sizes, dim=0)
    return output, torch.cat([prob_chunks[i] for i in order], dim=0)
