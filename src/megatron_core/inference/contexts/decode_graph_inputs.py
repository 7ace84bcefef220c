"""Static input tensors of a decode step, for CUDA-graph replay (helper of ``DynamicInferenceContext``).

A decode-only step of ``n`` requests is padded to a batch size ``B`` (a power of two, or
``max_requests``). For each ``B`` one set of tensors lives at fixed addresses: token ids,
positions, KV slots, block tables of a fixed width (enough blocks for ``max_sequence_length``),
KV lengths and the attention mask. Padding rows write their key/value into a scratch block that no
request owns and attend only to its first slot, so they never touch real requests' data.
"""

from __future__ import annotations

import torch

__all__ = ["DecodeGraphInputs", "graph_batch_sizes"]


def graph_batch_sizes(max_requests: int) -> list[int]:
    """Padded decode batch sizes: powers of two below ``max_requests``, then ``max_requests``."""
    sizes, b = [], 1
    while b < max_requests:
        sizes.append(b)
        b *= 2
    return sizes + [max_requests]


class DecodeGraphInputs:
    """Fixed-address tensors of a padded decode batch of ``batch`` requests."""

    def __init__(self, batch: int, width: int, block_size: int, scratch_block: int, device: torch.device) -> None:
        self.batch, self.width, self.block_size, self.scratch_block = batch, width, block_size, scratch_block
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(1, batch, **long)
        self.position_ids = torch.zeros(1, batch, **long)
        self.slot_mapping = torch.zeros(batch, **long)
        self.tables = torch.zeros(batch, width, **long)
        self.kv_len = torch.ones(batch, **long)
        self.mask = torch.zeros(batch, 1, 1, width * block_size, dtype=torch.bool, device=device)
        self._arange = torch.arange(width * block_size, **long)

    def fill(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]) -> None:
        """Copy one step's values in (padding the rest) and rebuild the mask."""
        pad = self.batch - len(ids)
        scratch_slot = self.scratch_block * self.block_size
        rows = [t + [self.scratch_block] * (self.width - len(t)) for t in tables]
        rows += [[self.scratch_block] * self.width] * pad
        host = torch.tensor(
            [ids + [0] * pad, positions + [0] * pad, slots + [scratch_slot] * pad, [p + 1 for p in positions] + [1] * pad],
            dtype=torch.long,
        )
        device = self.input_ids.device
        host = host.to(device, non_blocking=True)
        self.input_ids[0].copy_(host[0])
        self.position_ids[0].copy_(host[1])
        self.slot_mapping.copy_(host[2])
        self.kv_len.copy_(host[3])
        self.tables.copy_(torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True))
        torch.lt(self._arange[None, :], self.kv_len[:, None], out=self.mask.view(self.batch, -1))
