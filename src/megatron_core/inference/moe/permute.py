"""Token permutation for the fused inference MoE (Megatron-Core's ``inference.moe.permute``), in PyTorch.

The routing is dense: ``routing_map [max_tokens, topk]`` holds global expert ids. Only the first
``valid_tokens`` rows (a one-element int tensor, so a captured graph can replay with a new count) and
the (token, slot) pairs whose expert lives on this rank (``[local_expert_start, local_expert_start +
num_local_experts)``) are used. Each local expert gets a block of rows whose length is its pair count
rounded up to ``alignment``; the buffers are sized for the worst case so their shapes never change.

Megatron-Core runs these as Triton kernels that claim rows with atomics, so the order of the rows
inside an expert's block varies from run to run; here it is the (token, slot) order, and every row
outside the pairs (alignment padding and the unused tail) is defined: zero data, ``-1`` in the map.
Nothing here reads a count back to the host. The MXFP8 variant is not provided.
"""

from __future__ import annotations

import torch

__all__ = [
    "compute_expert_offsets",
    "compute_local_tokens_per_expert",
    "init_permutation_map",
    "permute_and_quantize_mxfp8",
    "permute_tokens",
    "unpermute_tokens",
]

MXFP8_REFUSAL = ("MXFP8 inference MoE kernels (Megatron-Core's MXFP8Tensor with swizzled e8m0 scales and "
                 "scaled_grouped_mm) are not provided by this library; use bf16/fp32 weights")


def _local_pair_ids(routing_map: torch.Tensor, local_expert_start: int, num_local_experts: int,
                    valid_tokens: torch.Tensor) -> torch.Tensor:
    """``[max_tokens * topk]`` local expert id of each (token, slot) pair, ``num_local_experts`` where unused."""
    topk = routing_map.shape[1]
    local = routing_map.reshape(-1).long() - local_expert_start
    token = torch.arange(local.numel(), device=routing_map.device) // topk
    valid = token < valid_tokens.reshape(-1)[:1].to(token.device)
    keep = (local >= 0) & (local < num_local_experts) & valid
    return torch.where(keep, local, torch.full_like(local, num_local_experts))


def compute_local_tokens_per_expert(routing_map: torch.Tensor, local_expert_start: int, num_local_experts: int,
                                    valid_tokens: torch.Tensor, persistent: bool = False) -> torch.Tensor:
    """``[num_local_experts]`` int32: the valid (token, slot) pairs routed to each local expert.

    ``persistent`` picks a kernel launch shape in Megatron-Core and has no effect here.
    """
    ids = _local_pair_ids(routing_map, local_expert_start, num_local_experts, valid_tokens)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int32, device=routing_map.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:num_local_experts]


def compute_expert_offsets(tokens_per_expert: torch.Tensor, alignment: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exclusive, inclusive)`` prefix sums of the counts rounded up to ``alignment`` (zero stays zero)."""
    if alignment < 1:
        raise ValueError(f"alignment ({alignment}) must be >= 1")
    aligned = (tokens_per_expert + alignment - 1) // alignment * alignment
    inclusive = torch.cumsum(aligned, 0).to(tokens_per_expert.dtype)
    return inclusive - aligned.to(tokens_per_expert.dtype), inclusive


def init_permutation_map(permutation_map: torch.Tensor, n_used: torch.Tensor) -> None:
    """Set ``permutation_map[:n_used]`` to ``-1`` in place (``n_used`` a one-element int tensor)."""
    rows = torch.arange(permutation_map.shape[0], device=permutation_map.device)
    permutation_map.masked_fill_(rows < n_used.reshape(-1)[:1].to(rows.device), -1)


def permute_tokens(hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                   local_expert_start: int, num_local_experts: int, valid_tokens: torch.Tensor, alignment: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the local (token, slot) pairs by expert.

    ``hidden_states [max_tokens, h]``, ``probs`` and ``routing_map`` ``[max_tokens, topk]``. Returns
    ``(permuted_hidden [R, h], permuted_probs [R], permutation_map [R] int32, inclusive_offsets [E] int32)`` with
    ``R = max_tokens * min(topk, E) + alignment * E``: expert ``e``'s rows start at ``inclusive_offsets[e - 1]``
    (0 for the first), and ``permutation_map`` gives each row's source token, ``-1`` for padding rows.
    """
    max_tokens, hidden_size = hidden_states.shape
    topk = probs.shape[1]
    device = hidden_states.device
    ids = _local_pair_ids(routing_map, local_expert_start, num_local_experts, valid_tokens)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    exclusive, inclusive = compute_expert_offsets(counts[:num_local_experts], alignment)
    output_size = max_tokens * min(topk, num_local_experts) + alignment * num_local_experts

    order = torch.argsort(ids, stable=True)  # pairs grouped by local expert, (token, slot) order inside
    sorted_ids = ids[order]
    group_start = torch.cumsum(counts, 0) - counts  # start of each id's run in the sorted order
    rank_in_group = torch.arange(ids.numel(), device=device) - group_start.long()[sorted_ids]
    starts = torch.cat([exclusive.long(), exclusive.new_full((1,), output_size).long()])
    rows = torch.where(sorted_ids < num_local_experts, starts[sorted_ids] + rank_in_group,
                       torch.full_like(rank_in_group, output_size))  # unused pairs land on a dropped extra row
    token = order // topk

    permuted_hidden = hidden_states.new_zeros(output_size + 1, hidden_size)
    permuted_hidden[rows] = hidden_states[token]
    permuted_probs = probs.new_zeros(output_size + 1)
    permuted_probs[rows] = probs.reshape(-1)[order]
    permutation_map = torch.full((output_size + 1,), -1, dtype=torch.int32, device=device)
    permutation_map[rows] = token.to(torch.int32)
    permutation_map[output_size] = -1
    return permuted_hidden[:output_size], permuted_probs[:output_size], permutation_map[:output_size], inclusive


def unpermute_tokens(expert_output: torch.Tensor, permuted_probs: torch.Tensor, permutation_map: torch.Tensor,
                     num_tokens: int, n_used: torch.Tensor, valid_tokens: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Scatter ``prob * expert_output`` rows back to their tokens, summed in fp32: ``[num_tokens, h]`` fp32.

    Rows ``>= n_used`` and padding rows (map ``-1``) are skipped. With ``out`` (fp32, ``[num_tokens, h]``) its
    rows ``< valid_tokens`` are zeroed and accumulated into and the rest left untouched; without it, a new
    zeroed buffer is returned.
    """
    if permuted_probs.dtype != torch.float32:
        raise ValueError(f"unpermute_tokens: permuted_probs must be float32, got {permuted_probs.dtype}")
    hidden_size = expert_output.shape[1]
    device = expert_output.device
    if out is None:
        out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=device)
    else:
        token_rows = torch.arange(out.shape[0], device=device)
        out.masked_fill_((token_rows < valid_tokens.reshape(-1)[:1].to(device))[:, None], 0.0)
    rows = torch.arange(permutation_map.shape[0], device=device)
    used = (rows < n_used.reshape(-1)[:1].to(device)) & (permutation_map >= 0)
    contribution = torch.where(used[:, None], expert_output.float() * permuted_probs[:, None],
                               torch.zeros((), dtype=torch.float32, device=device))
    target = torch.where(used, permutation_map.long(), torch.zeros_like(rows))
    out.index_add_(0, target, contribution.to(out.dtype))
    return out


def permute_and_quantize_mxfp8(hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                               local_expert_start: int, num_local_experts: int, valid_tokens: torch.Tensor,
                               alignment: int = 128) -> tuple:
    """Megatron-Core's fused permute + MXFP8 quantization: raises ``NotImplementedError`` (not provided)."""
    raise NotImplementedError(f"permute_and_quantize_mxfp8: {MXFP8_REFUSAL}")
