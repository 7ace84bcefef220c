"""Padding-free audio embeddings (Megatron-Core's ``PackedAudioEmbeddings``, ``models.audio.packed_audio``).

The valid embeddings of several clips are concatenated into one ``[total_tokens, hidden]`` tensor, with one
length per clip; ``cu_seqlens`` gives the THD-style boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedAudioEmbeddings"]


@dataclass
class PackedAudioEmbeddings:
    """``embeddings`` ``[sum(lengths), hidden]``: the clips' valid embeddings back to back; ``lengths`` ``[clips]``."""

    embeddings: torch.Tensor
    lengths: torch.Tensor

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``[clips + 1]`` int32 clip boundaries ``[0, l0, l0 + l1, ...]`` on the embeddings' device."""
        lengths = self.lengths.to(dtype=torch.int32, device=self.embeddings.device)
        return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))

    def pad_to_lengths(self, target_lengths: torch.Tensor) -> PackedAudioEmbeddings:
        """Append zero rows to each clip up to ``target_lengths`` (never shortens; ``self`` when nothing grows)."""
        device = self.embeddings.device
        lengths = self.lengths.to(dtype=torch.int32, device=device)
        targets = torch.maximum(target_lengths.to(dtype=torch.int32, device=device), lengths)
        if torch.equal(targets, lengths):
            return self
        hidden = self.embeddings.shape[-1]
        pieces = []
        start = 0
        for length, target in zip(lengths.tolist(), targets.tolist()):
            pieces.append(self.embeddings[start:start + length])
            if target > length:
                pieces.append(self.embeddings.new_zeros(target - length, hidden))
            start += length
        embeddings = torch.cat(pieces, dim=0) if pieces else self.embeddings.new_zeros(0, hidden)
        return PackedAudioEmbeddings(embeddings=embeddings, lengths=targets)
