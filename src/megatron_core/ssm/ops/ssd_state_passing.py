"""The inter-chunk recurrence of the varlen SSD scan (Megatron-Core 0.19's ``ssm.ops.ssd_state_passing``).

``_state_passing_fwd`` walks the chunks in order: ``state = exp(dA_chunk) * state + chunk_state``, restarting at
each new sequence (``seq_idx`` changes) from that sequence's initial state (zeros without ``initial_states``). It
returns the state at the end of every chunk. The walk is sequential over chunks and vectorised over heads and the
flattened ``headdim x dstate``; fp32 inside.
"""

from __future__ import annotations

import torch

__all__: list[str] = []


def _state_passing_fwd(states: torch.Tensor, dA_cumsum: torch.Tensor, cu_chunk_seqlens: torch.Tensor,
                       seq_idx: torch.Tensor, initial_states: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[nchunks, nheads, dim]``: the state after each chunk, from ``states`` ``[nchunks, nheads, dim]`` (each
    chunk's own contribution), ``dA_cumsum`` ``[nheads, nchunks, chunk_size]`` (its last column: the chunk's whole
    decay), ``seq_idx`` ``[nchunks]`` and ``initial_states`` ``[batch, nheads, dim]``; in ``out_dtype`` (default
    ``states``' dtype). ``cu_chunk_seqlens`` is accepted for 0.19's signature (the decays already account for it)."""
    nchunks, nheads, dim = states.shape
    if dA_cumsum.shape[:2] != (nheads, nchunks) or seq_idx.shape != (nchunks,):
        raise ValueError(f"_state_passing_fwd: dA_cumsum {tuple(dA_cumsum.shape)} must be ({nheads}, {nchunks}, "
                         f"chunk_size) and seq_idx {tuple(seq_idx.shape)} ({nchunks},)")
    out = torch.empty(nchunks, nheads, dim, device=states.device, dtype=out_dtype or states.dtype)
    decay = torch.exp(dA_cumsum[:, :, -1].float())  # [nheads, nchunks]
    sequences = seq_idx.tolist()

    def start_of(sequence: int) -> torch.Tensor:
        if initial_states is None:
            return states.new_zeros(nheads, dim, dtype=torch.float32)
        return initial_states[sequence].float()

    state, previous = start_of(0), 0
    for c, sequence in enumerate(sequences):
        if sequence != previous:
            state = start_of(sequence)
        previous = sequence
        state = decay[:, c, None] * state + states[c].float()
        out[c] = state.to(out.dtype)
    return out
