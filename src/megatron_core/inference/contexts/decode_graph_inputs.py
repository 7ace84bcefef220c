"""Static input tensors of a decode step, for CUDA-graph replay (helper of ``DynamicInferenceContext``).

A decode-only step of ``n`` requests is padded to the next batch size ``B`` that has a graph
(:func:`graph_batch_sizes`: powers of two, or a linear spacing, and ``max_requests``). For each ``B`` one set of tensors lives at fixed addresses: token ids,
positions, KV slots, block tables of a fixed width (enough blocks for ``max_sequence_length``),
KV lengths and the attention mask. Padding rows write their key/value into a scratch block that no
request owns and attend only to its first slot, so they never touch real requests' data.

A step may also take its token ids from a tensor already on the device (the previous step's
samples, which the host has not read yet): ``fill(..., source_rows=rows)`` uploads the row of that
tensor each request reads, and :meth:`DecodeGraphInputs.take_tokens` gathers them in place.
"""

from __future__ import annotations

import torch

__all__ = ["DecodeGraphInputs", "graph_batch_sizes"]


def graph_batch_sizes(max_requests: int, distribution: str = "exponential", multiple: int = 1) -> list[int]:
    """Padded decode batch sizes, ascending, ending at ``max_requests``: ``"exponential"`` 1, 2, 4, 8, ...;
    ``"linear"`` 1, 2, 4, then every multiple of 8 below 256 and every multiple of 16 from 256 on (the values of
    ``InferenceConfig.cuda_graph_sizing_distribution``). With ``multiple`` > 1 (the TP size of a sequence-parallel
    model) each size is rounded up to a multiple of it, duplicates dropped, so the last may exceed ``max_requests``."""
    if multiple < 1:
        raise ValueError(f"graph_batch_sizes: multiple must be >= 1, got {multiple}")
    if multiple > 1:
        return sorted({-(-size // multiple) * multiple for size in graph_batch_sizes(max_requests, distribution)})
    if distribution == "exponential":
        below, size = [], 1
        while size < max_requests:
            below.append(size)
            size *= 2
    elif distribution == "linear":
        below = [b for b in [1, 2, 4, *range(8, 256, 8), *range(256, max_requests, 16)] if b < max_requests]
    else:
        raise ValueError(f"graph batch size distribution {distribution!r}: choose 'exponential' or 'linear'")
    return below + [max_requests]


class DecodeGraphInputs:
    """Fixed-address tensors of a padded decode batch of ``batch`` requests."""

    def __init__(self, batch: int, width: int, block_size: int, scratch_block: int, device: torch.device) -> None:
        self.batch, self.width, self.block_size, self.scratch_block = batch, width, block_size, scratch_block
        long = dict(dtype=torch.long, device=device)
        # One flat buffer, so that a step's inputs arrive in one host-to-device copy; the named
        # tensors are fixed views of it.
        self._flat = torch.zeros(5 * batch + batch * width, **long)
        self.input_ids = self._flat[:batch].view(1, batch)
        self.position_ids = self._flat[batch : 2 * batch].view(1, batch)
        self.slot_mapping = self._flat[2 * batch : 3 * batch]
        self.kv_len = self._flat[3 * batch : 4 * batch]
        self.source_rows = self._flat[4 * batch : 5 * batch]
        self.tables = self._flat[5 * batch :].view(batch, width)
        self.kv_len.fill_(1)
        self.mask = torch.zeros(batch, 1, 1, width * block_size, dtype=torch.bool, device=device)
        self._arange = torch.arange(width * block_size, **long)
        pinned = device.type == "cuda"
        self._host = torch.empty(self._flat.numel(), dtype=torch.long, pin_memory=pinned)
        self._copied = torch.cuda.Event() if pinned else None
        self._tables_key: object = None

    def fill(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
             tables_key: object = None, source_rows: list[int] | None = None) -> None:
        """Copy one step's values in (padding the rest) and rebuild the mask.

        ``tables_key`` identifies the block tables' contents (the context's block-table version and the
        rows' request ids): when it equals the previous fill's, the tables are not copied again.
        ``source_rows``: for :meth:`take_tokens`, the row of the token tensor each request reads.
        """
        pad = self.batch - len(ids)
        scratch = self.scratch_block
        values = ids + [0] * pad
        values += positions + [0] * pad
        values += slots + [scratch * self.block_size] * pad
        values += [p + 1 for p in positions] + [1] * pad
        values += (source_rows or [0] * len(ids)) + [0] * pad
        same_tables = tables_key is not None and tables_key == self._tables_key
        if not same_tables:
            for table in tables:
                values += table[: self.width]
                values += [scratch] * (self.width - len(table))
            values += [scratch] * (self.width * pad)
        self._tables_key = tables_key
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned buffer
        n = len(values)
        self._host[:n].copy_(torch.tensor(values, dtype=torch.long))
        self._flat[:n].copy_(self._host[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        torch.lt(self._arange[None, :], self.kv_len[:, None], out=self.mask.view(self.batch, -1))

    def take_tokens(self, source: torch.Tensor) -> None:
        """Token ids ``source[source_rows]`` into :attr:`input_ids`, on the device (padding rows read row 0)."""
        torch.index_select(source, 0, self.source_rows, out=self.input_ids.view(-1))
