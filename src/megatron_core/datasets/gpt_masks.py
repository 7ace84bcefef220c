"""Left-to-right masks and position ids of a GPT sample, with optional resets at EOD tokens.

Megatron's ``_get_ltor_masks_and_position_ids`` loops over the EOD tokens; this version computes
the same tensors without a Python loop. Token ``k`` belongs to segment ``s(k)`` = number of EODs
before ``k`` (an EOD ends its own segment). ``reset_position_ids`` numbers positions from 0 within
each segment; ``reset_attention_mask`` lets a query see only keys of its own segment. The returned
``attention_mask`` is ``[1, s, s]`` bool with True meaning "masked out".
"""

from __future__ import annotations

import torch


def get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(attention_mask or None, loss_mask float32 [s], position_ids int64 [s])`` for token ids ``data`` [s]."""
    seq_length = data.numel()
    is_eod = data == eod_token
    loss_mask = torch.ones(seq_length, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0

    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    # segment[k] = number of EOD tokens at positions < k.
    segment = torch.cumsum(is_eod.long(), dim=0) - is_eod.long()
    if reset_position_ids:
        eod_positions = torch.where(is_eod, position_ids, torch.full_like(position_ids, -1))
        last_eod_before = torch.cummax(eod_positions, dim=0).values
        previous = torch.cat([torch.full((1,), -1, dtype=torch.long, device=data.device), last_eod_before[:-1]])
        position_ids = position_ids - (previous + 1)

    attention_mask = None
    if create_attention_mask:
        visible = torch.ones((seq_length, seq_length), dtype=torch.bool, device=data.device).tril()
        if reset_attention_mask:
            visible &= segment.unsqueeze(1) == segment.unsqueeze(0)
        attention_mask = (~visible).unsqueeze(0)
    return attention_mask, loss_mask, position_ids
