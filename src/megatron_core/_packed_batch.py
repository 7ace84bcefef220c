"""Turning a micro-batch of packed samples into one packed sequence (``utils.flatten_batch_for_packed_sequences``).

A packed-sequence data loader gives, per sample, the token stream ``[mbs, seq_length]`` and the
cumulative document boundaries ``cu_seqlens`` ``[mbs, n]``, each row ``0, ..., seq_length``
right-padded with extra copies of ``seq_length``. THD attention wants one stream and one boundary
list, so the samples are laid end to end and their boundaries shifted and joined.
"""

from __future__ import annotations

from typing import Any

import torch

_SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _valid_boundaries(row: torch.Tensor, seq_length: int) -> torch.Tensor:
    """``row`` up to and including its first ``seq_length`` (the rest is padding); all of it if none."""
    ends = torch.nonzero(row == seq_length).flatten()
    return row if ends.numel() == 0 else row[: int(ends[0]) + 1]


def _join_boundaries(cu_seqlens: torch.Tensor, seq_length: int, key: str) -> torch.Tensor:
    """One 1-D boundary list for the samples of ``cu_seqlens`` placed one after another."""
    if cu_seqlens.dim() != 2 or cu_seqlens.shape[0] == 0:
        raise ValueError(
            f"flatten_batch_for_packed_sequences: batch[{key!r}] must be 2-D [micro_batch_size, n] with at least "
            f"one row, got shape {tuple(cu_seqlens.shape)}"
        )
    pieces = [_valid_boundaries(cu_seqlens[0], seq_length)]
    for sample in range(1, cu_seqlens.shape[0]):
        # every later sample drops its leading 0 (it equals the previous sample's end) and is shifted
        pieces.append(_valid_boundaries(cu_seqlens[sample], seq_length)[1:] + sample * seq_length)
    return torch.cat(pieces)


def flatten_batch_for_packed_sequences(batch: dict[str, Any]) -> dict[str, Any]:
    """Make a packed micro-batch one sequence for THD attention; ``batch`` is changed in place and returned.

    Without ``batch["cu_seqlens"]`` (or with it ``None``) nothing changes. Otherwise, with
    ``seq_length`` the second dimension of ``tokens`` (else ``labels``, ``loss_mask``,
    ``position_ids``; else the last boundary of the first sample):

    * ``cu_seqlens`` ``[mbs, n]`` becomes ``[1, m]``: each row cut after its first ``seq_length``,
      sample ``i``'s boundaries shifted by ``i * seq_length``, the rows joined (the leading 0 of
      every row but the first dropped); ``cu_seqlens_padded`` likewise when present;
    * ``max_seqlen`` becomes its maximum, shape ``[1]``;
    * ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` become ``[1, mbs * seq_length]``.

    With one sample only the padding of the boundaries is removed (and a leading dimension of 1 kept).
    """
    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is None:
        return batch
    present = [key for key in _SEQUENCE_KEYS if batch.get(key) is not None]
    if present:
        seq_length = int(batch[present[0]].shape[1])
    else:
        seq_length = int(cu_seqlens[0, -1]) if cu_seqlens.dim() == 2 else -1

    batch["cu_seqlens"] = _join_boundaries(cu_seqlens, seq_length, "cu_seqlens").unsqueeze(0)
    if batch.get("cu_seqlens_padded") is not None:
        batch["cu_seqlens_padded"] = _join_boundaries(
            batch["cu_seqlens_padded"], seq_length, "cu_seqlens_padded"
        ).unsqueeze(0)
    if batch.get("max_seqlen") is not None:
        batch["max_seqlen"] = batch["max_seqlen"].max().unsqueeze(0)
    for key in present:
        batch[key] = batch[key].reshape(1, -1)
    return batch
