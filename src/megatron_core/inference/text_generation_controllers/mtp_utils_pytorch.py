"""Tensor helpers of speculative decoding with MTP drafts (Megatron-Core's ``mtp_utils_pytorch``).

The layout they work on: a step's required tokens packed request after request, each decoding request
contributing ``num_speculative_tokens + 1`` rows (its last token, then its drafts) and each prefilling
request one row (its last prompt token). Row ``i`` of ``output_tokens`` is what the main model chose after
row ``i`` of ``input_tokens``, so draft ``j`` of a request is accepted when it equals the choice after the
row before it and every earlier draft was accepted.

The dynamic engine of this library keeps its block tables as Python lists and verifies per request
(:mod:`.text_generation_controller`); these functions are the same rules over the padded tensors that
Megatron-Core's context keeps, for code that calls them directly.
"""

from __future__ import annotations

import torch

__all__ = [
    "mamba_state_selective_copy",
    "prepare_next_forward_pass",
    "rewind_kv_cache",
    "verify_speculative_tokens",
]


def rewind_kv_cache(
    accepted_counts: torch.Tensor,
    prefill_status: torch.Tensor,
    last_kv_block_offset: torch.Tensor,
    kv_length_offsets: torch.Tensor,
    kv_block_counts: torch.Tensor,
    last_kv_block_id: torch.Tensor,
    kv_block_ids: torch.Tensor,
    num_speculative_tokens: int,
    block_size_tokens: int,
    num_active_requests: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Take the rejected drafts of each decoding request back out of the KV bookkeeping (tensors edited in place).

    A decoding request (``prefill_status`` 0) drops ``num_speculative_tokens - accepted_counts[i]`` tokens; when
    that moves its end before the start of its last block, the block is given up: its count shrinks by one,
    ``last_kv_block_id`` becomes the block before and the table entry is set to -1. Prefilling requests and
    rows from ``num_active_requests`` on are untouched. Returns ``(blocks_to_release, remove_mask)``: the
    old last block of every row and whether the caller must release it.
    """
    n = accepted_counts.shape[0]
    active = n if num_active_requests is None else num_active_requests
    live = torch.arange(n, device=accepted_counts.device) < active
    rewind = torch.where(prefill_status.to(torch.bool) | ~live, 0,
                         num_speculative_tokens - accepted_counts.to(kv_length_offsets.dtype))
    shifted = last_kv_block_offset - rewind.to(last_kv_block_offset.dtype)
    remove = (shifted < 0) & live
    blocks_to_release = torch.where(live, last_kv_block_id, torch.zeros_like(last_kv_block_id))
    last_kv_block_offset.copy_(torch.where(live, shifted.remainder(block_size_tokens), last_kv_block_offset))
    kv_length_offsets.sub_(rewind.to(kv_length_offsets.dtype))
    kv_block_counts.sub_(remove.to(kv_block_counts.dtype))
    rows = torch.nonzero(remove).flatten()
    if rows.numel():
        counts = kv_block_counts[rows].long()
        last_kv_block_id[rows] = kv_block_ids[rows, (counts - 1).clamp(min=0)].to(last_kv_block_id.dtype)
        kv_block_ids[rows, counts.clamp(max=kv_block_ids.shape[1] - 1)] = -1
    return blocks_to_release, remove


def verify_speculative_tokens(
    input_tokens: torch.Tensor,
    output_tokens: torch.Tensor,
    num_decode_requests: int,
    num_prefill_requests: int,
    num_speculative_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which packed rows are accepted: ``(last_one_indices, accepted_tokens_mask, input_tokens)``.

    The first row of a decoding request is always accepted, draft ``j`` when it equals the output of the row
    before it and draft ``j - 1`` was accepted; prefill rows are always accepted. ``last_one_indices[r]`` is
    the packed index of request ``r``'s last accepted row (where its next token is read).
    """
    if input_tokens.dim() == 2:
        input_tokens = input_tokens.squeeze(0)
    stride = num_speculative_tokens + 1
    decode_rows = num_decode_requests * stride
    mask = torch.zeros_like(input_tokens, dtype=torch.bool)
    last = torch.empty(num_decode_requests + num_prefill_requests, dtype=torch.long, device=input_tokens.device)
    if num_decode_requests:
        fed = input_tokens[:decode_rows].view(num_decode_requests, stride)
        chosen = output_tokens[:decode_rows].view(num_decode_requests, stride)
        match = torch.ones_like(fed, dtype=torch.bool)
        match[:, 1:] = fed[:, 1:] == chosen[:, :-1]
        match = match.long().cummin(dim=1).values.bool()
        mask[:decode_rows] = match.flatten()
        starts = torch.arange(num_decode_requests, device=input_tokens.device) * stride
        last[:num_decode_requests] = starts + match.sum(dim=1) - 1
    if num_prefill_requests:
        mask[decode_rows:decode_rows + num_prefill_requests] = True
        last[num_decode_requests:] = torch.arange(num_prefill_requests, device=input_tokens.device) + decode_rows
    return last, mask, input_tokens


def prepare_next_forward_pass(
    num_decode_requests: int,
    output_tokens: torch.Tensor,
    required_logit_indices: torch.Tensor,
    last_one_indices: torch.Tensor,
    accepted_tokens_mask: torch.Tensor,
    input_tokens: torch.Tensor,
    sampled_tokens_buf: torch.Tensor,
    last_accepted_seq_buf: torch.Tensor,
    accepted_tokens_per_request: torch.Tensor,
    accepted_token_counts: torch.Tensor,
    num_speculative_tokens: int,
) -> None:
    """Fill the caller's buffers after :func:`verify_speculative_tokens`.

    Per request ``r``: ``sampled_tokens_buf[r]`` is the token chosen at its last accepted row (fed next),
    ``last_accepted_seq_buf[r]`` that row's index in the step's sequence (where the MTP drafting reads the
    hidden state). Per decoding request: ``accepted_tokens_per_request[r, j]`` is draft ``j`` if accepted,
    else -1, and ``accepted_token_counts[r]`` the number accepted.
    """
    count = last_one_indices.shape[0]
    sampled_tokens_buf[:count] = output_tokens[last_one_indices]
    last_accepted_seq_buf[:count] = required_logit_indices[last_one_indices]
    if num_decode_requests and num_speculative_tokens:
        stride = num_speculative_tokens + 1
        rows = num_decode_requests * stride
        drafts = input_tokens[:rows].view(num_decode_requests, stride)[:, 1:]
        kept = accepted_tokens_mask[:rows].view(num_decode_requests, stride)[:, 1:]
        accepted_tokens_per_request[:num_decode_requests] = torch.where(kept, drafts, torch.full_like(drafts, -1))
        accepted_token_counts[:num_decode_requests] = kept.sum(dim=1)


def mamba_state_selective_copy(
    intermediate_states: torch.Tensor,
    current_states: torch.Tensor,
    prefill_status: torch.Tensor,
    state_idx: torch.Tensor,
    accepted_counts: torch.Tensor,
    num_layers: int,
) -> None:
    """Set each decoding request's Mamba state to the one after its last accepted token.

    ``intermediate_states[layer, slot, j]`` is the state after ``j`` accepted drafts; decoding request ``i``
    (``prefill_status`` 0) in slot ``state_idx[i]`` gets ``intermediate_states[layer, slot, accepted_counts[i]]``
    in ``current_states[layer, slot]`` for the first ``num_layers`` layers.
    """
    rows = torch.nonzero(prefill_status == 0).flatten()
    if not rows.numel():
        return
    slots = state_idx[rows].long()
    steps = accepted_counts[rows].long()
    for layer in range(num_layers):
        current_states[layer, slots] = intermediate_states[layer, slots, steps]
