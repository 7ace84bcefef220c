"""The layout of one continuous-batching step of the dynamic context (Megatron-Core's
``DynamicInferenceContext.initialize_attention_state`` and its attention metadata).

The engine hands one :class:`StepEntry` per scheduled request: one token for a decoding request, a prompt or a
chunk of it (chunked prefill) for a prefilling one. All of the step's tokens are flattened into one sequence
``[1, T]``, decode tokens first, and for each token this records its own position and its KV slot
(``table[p // block_size] * block_size + p % block_size``); for the decode rows, their block tables and a
validity mask; per prefill chunk, ``(first row, rows, cached length, block table or None for a fresh prompt)``;
and the rows whose logits the step needs.

A decode-only step that a CUDA graph runs is laid out into the static tensors of the smallest graph batch size
that fits (:class:`~.decode_graph_inputs.DecodeGraphInputs`), its padding rows writing a scratch block.

For a sequence-parallel model under tensor parallelism (Megatron-Core's ``round_up_tokens``) every step's token
count is padded to a multiple of the TP size (:func:`step_token_multiple`; the graph batch sizes are multiples of
it too), so that the embedding can split the sequence evenly over the TP ranks. The padding rows come after the
prefill chunks: token 0 at position 0, writing the scratch block; no request's attention reads them, attention and
the Mamba mixers give them zeros, and no logits row is taken from them. ``active_token_count`` and
``padded_active_token_count`` are the step's real and padded token counts, ``padding_slice`` the padding rows.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.inference.contexts.decode_graph_inputs import DecodeGraphInputs
from megatron_core.inference.contexts.mamba_step_slots import MambaStepSlots
from megatron_core.inference.contexts.overflow_errors import BlockOverflowError, TokenOverflowError
from megatron_core.inference.contexts.request_bookkeeping import RequestBookkeeping
from megatron_core.inference.contexts.step_entry import StepEntry

__all__ = ["StepLayout", "step_token_multiple"]


def step_token_multiple(model_config: Any) -> int:
    """What a dynamic step's token count is padded to a multiple of: the TP size of a model with
    ``sequence_parallel`` (its embedding splits the step's tokens over the TP ranks), else 1."""
    tp = int(getattr(model_config, "tensor_model_parallel_size", 1) or 1)
    return tp if getattr(model_config, "sequence_parallel", False) and tp > 1 else 1


class StepLayout(RequestBookkeeping, MambaStepSlots):
    """Lays out the dynamic context's steps over its requests' blocks (a mixin: the context's ``__init__`` sets
    the state it reads)."""

    max_tokens: int
    materialize_only_last_token_logits: bool
    scratch_block: int
    use_cuda_graphs: bool
    graph_sizes: list[int]
    graph_inputs: dict[int, DecodeGraphInputs]
    graph_batch_size: int | None
    pad_decode_steps_on_cpu: bool
    step_token_multiple: int
    sequence_padding_start: int  # the first row of a sequence-parallel step's padding (the Mamba mixer derives it
    # from mamba_step_layout() instead, the protocol its contexts implement)

    def is_decode_only(self) -> bool:
        """Whether every request of the current step feeds exactly one token."""
        return all(len(e.tokens) == 1 for e in self.step_entries)

    def initialize_attention_state(
        self, entries: list[StepEntry], device_tokens: torch.Tensor | None = None,
        device_token_rows: list[int] | None = None,
    ) -> None:
        """Lay out one step: decode entries first, then prefill chunks; build positions, slots and tables.

        With ``device_tokens``, every entry is a decode entry whose token is not known on the host
        yet: entry ``i`` reads row ``device_token_rows[i]`` of that device tensor (the previous step's
        samples), gathered on the device without waiting for it.
        """
        if not entries:
            raise ValueError("initialize_attention_state: a step needs at least one entry")
        if device_tokens is not None and (device_token_rows is None or len(device_token_rows) != len(entries)
                                          or any(len(e.tokens) != 1 for e in entries)):
            raise ValueError("initialize_attention_state: device_tokens needs one row per entry, all decode entries")
        device = self.device or torch.device("cpu")
        decode = [e for e in entries if len(e.tokens) == 1]
        prefill = [e for e in entries if len(e.tokens) > 1]
        padded = device.type == "cuda" or self.pad_decode_steps_on_cpu
        if (self.use_cuda_graphs and padded and not prefill and len(decode) <= min(self.graph_sizes[-1], self.max_tokens)
                and all(e.sample and not e.all_logits for e in decode)):
            self._decode_graph_step(decode, device, device_tokens, device_token_rows)
            return
        self.step_entries = decode + prefill
        total = sum(len(e.tokens) for e in self.step_entries)
        if total > self.max_tokens:
            raise TokenOverflowError(None, f"step of {total} tokens exceeds max_tokens ({self.max_tokens})")
        bs = self.block_size_tokens
        ids, positions, slots, logit_index = [], [], [], []
        self._prefill_segments: list[tuple[int, int, int, torch.Tensor | None]] = []
        offset = 0
        for entry in self.step_entries:
            blocks = self.request_blocks[entry.request_id]
            if self.request_kv_length[entry.request_id] != entry.start:
                raise ValueError(
                    f"request {entry.request_id}: step starts at position {entry.start} but the cache holds "
                    f"{self.request_kv_length[entry.request_id]} tokens"
                )
            n = len(entry.tokens)
            end = entry.start + n
            if len(blocks) * bs < end:
                raise BlockOverflowError(entry.request_id, f"holds {len(blocks)} blocks, needs {self.blocks_for_tokens(end)}")
            ids.extend(entry.tokens)
            pos = range(entry.start, end)
            positions.extend(pos)
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            if entry.all_logits or entry.draft_tokens or not self.materialize_only_last_token_logits:
                rows = list(range(offset, offset + n))
            elif entry.sample:
                rows = [offset + n - 1]
            else:
                rows = []
            entry.logit_rows = list(range(len(logit_index), len(logit_index) + len(rows)))
            logit_index.extend(rows)
            if n > 1:
                table = None if entry.start == 0 else torch.tensor(blocks[: self.blocks_for_tokens(end)], device=device)
                self._prefill_segments.append((offset, n, end, table))
            offset += n
        self.num_decode = len(decode)
        self.graph_batch_size = None
        self._lay_out_mamba_step(decode, prefill, [(first, n) for first, n, _, _ in self._prefill_segments], device)
        if self.use_cuda_graphs and not prefill and padded and self._all_last_rows(logit_index, total):
            self._graph_layout(decode, ids, positions, slots, device, None, device_tokens, device_token_rows)
            return
        pad = -total % self.step_token_multiple
        if pad:  # sequence parallelism: rows that write the scratch block and feed no logits
            ids.extend([0] * pad)
            positions.extend([0] * pad)
            slots.extend(self.scratch_block * bs + row % bs for row in range(pad))
        self._set_token_counts(total, total + pad)
        self.sequence_padding_start = total
        self.input_ids = torch.tensor(ids, dtype=torch.long, device=device).unsqueeze(0)
        if device_tokens is not None:
            self.input_ids[0, :total] = device_tokens[torch.tensor(device_token_rows, device=device_tokens.device)]
        self.position_ids = torch.tensor(positions, dtype=torch.long, device=device).unsqueeze(0)
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        self.logit_index = torch.tensor(logit_index, dtype=torch.long, device=device)
        self._all_rows = len(logit_index) == total + pad
        if decode:
            lengths = [e.start + 1 for e in decode]
            width = max(self.blocks_for_tokens(n) for n in lengths)
            table = [self.request_blocks[e.request_id][:width] for e in decode]
            table = [t + [0] * (width - len(t)) for t in table]
            self._decode_tables = torch.tensor(table, dtype=torch.long, device=device)
            kv_len = self._decode_kv_len = torch.tensor(lengths, device=device)
            keep = torch.arange(width * bs, device=device)[None, :] < kv_len[:, None]
            self._decode_mask = keep[:, None, None, :]

    def _decode_graph_step(self, decode: list[StepEntry], device: torch.device, device_tokens: torch.Tensor | None,
                           device_token_rows: list[int] | None) -> None:
        """The layout of a decode-only step that a CUDA graph runs (the common step: kept to plain lists)."""
        self.step_entries = decode
        self._prefill_segments = []
        bs = self.block_size_tokens
        kv_lengths, request_blocks = self.request_kv_length, self.request_blocks
        ids, positions, slots, tables = [], [], [], []
        for row, entry in enumerate(decode):
            blocks = request_blocks[entry.request_id]
            position = entry.start
            if kv_lengths[entry.request_id] != position:
                raise ValueError(f"request {entry.request_id}: step starts at position {position} but the cache "
                                 f"holds {kv_lengths[entry.request_id]} tokens")
            if len(blocks) * bs <= position:
                raise BlockOverflowError(entry.request_id, f"holds {len(blocks)} blocks, needs "
                                         f"{self.blocks_for_tokens(position + 1)}")
            ids.append(entry.tokens[0])
            positions.append(position)
            slots.append(blocks[position // bs] * bs + position % bs)
            tables.append(blocks)
            entry.logit_rows = [row]
        self.num_decode = len(decode)
        self._graph_layout(decode, ids, positions, slots, device, tables, device_tokens, device_token_rows)

    @staticmethod
    def _all_last_rows(logit_index: list[int], total: int) -> bool:
        return len(logit_index) == total

    def _graph_layout(self, decode: list[StepEntry], ids: list[int], positions: list[int], slots: list[int],
                      device: torch.device, tables: list[list[int]] | None = None,
                      device_tokens: torch.Tensor | None = None, device_token_rows: list[int] | None = None) -> None:
        """Decode-only step into the static tensors of the smallest graph batch size that fits."""
        batch = next(b for b in self.graph_sizes if b >= len(decode))
        inputs = self.graph_inputs.get(batch)
        if inputs is None:
            width = self.blocks_for_tokens(self.max_sequence_length)
            inputs = self.graph_inputs[batch] = DecodeGraphInputs(
                batch, width, self.block_size_tokens, self.scratch_block, device
            )
        if tables is None:
            tables = [self.request_blocks[e.request_id] for e in decode]
        inputs.fill(ids, positions, slots, tables,
                    tables_key=(self.block_tables_version, tuple(e.request_id for e in decode)),
                    source_rows=device_token_rows)
        if device_tokens is not None:
            inputs.take_tokens(device_tokens)
        self.graph_batch_size = self.num_decode = batch
        self._set_token_counts(len(decode), batch)
        self.sequence_padding_start = batch  # a graph's padding rows are its own (scratch block), not zeroed
        self.input_ids, self.position_ids, self.slot_mapping = inputs.input_ids, inputs.position_ids, inputs.slot_mapping
        self._decode_tables, self._decode_mask, self._decode_kv_len = inputs.tables, inputs.mask, inputs.kv_len
        self._prefill_segments = []
        self._all_rows = True
        self._lay_out_mamba_graph_step(batch, [e.request_id for e in decode], device)

    def _set_token_counts(self, active: int, padded: int) -> None:
        self.active_token_count, self.padded_active_token_count = active, padded
        self.padding_slice = slice(active, padded)

    def current_input_and_position_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and positions of the step, ``[1, T]`` each."""
        return self.input_ids, self.position_ids

    def select_logit_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Only the rows whose logits the step needs: ``[T, 1, h]`` -> ``[L, 1, h]``."""
        if self._all_rows:
            return hidden_states
        return hidden_states.index_select(0, self.logit_index)
