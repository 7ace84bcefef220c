"""Megatron-Core 0.19's varlen Mamba-2 chunk scan entry point (``ssm.ops.ssd_combined``).

:func:`mamba_chunk_scan_combined_varlen` runs the SSD scan over a packed batch of sequences, each from its own
initial state, writes the outputs into a preallocated ``out`` and returns every sequence's final state. On CUDA with
Triton (and without ``return_raw_states``) it runs :mod:`megatron_core.ssm.ssd_scan_triton`'s forward on the
sequences laid out as one padded batch (:mod:`~megatron_core.ssm.ops.ssd_combined_triton`); elsewhere the five
PyTorch passes of 0.19's decomposition (chunk cumsum, chunk states, state passing, ``C B^T``, chunk scan) over the
caller's chunks. The SSD math does not depend on where the chunks are cut, so both give the same function.
"""

from __future__ import annotations

import torch

from megatron_core.ssm.ops.ssd_bmm import _bmm_chunk_fwd
from megatron_core.ssm.ops.ssd_chunk_scan import _chunk_scan_fwd
from megatron_core.ssm.ops.ssd_chunk_state import _chunk_cumsum_fwd, _chunk_state_fwd
from megatron_core.ssm.ops.ssd_combined_triton import combined_scan_triton, combined_triton_supported
from megatron_core.ssm.ops.ssd_state_passing import _state_passing_fwd

__all__ = ["is_int_pow_2", "mamba_chunk_scan_combined_varlen"]


def is_int_pow_2(n: object) -> bool:
    """Whether ``n`` is an ``int`` that is a positive power of two."""
    return isinstance(n, int) and n > 0 and (n & (n - 1)) == 0


def _check(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: int,
           cu_chunk_seqlens: torch.Tensor | None, last_chunk_indices: torch.Tensor | None,
           seq_idx: torch.Tensor | None, out: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
           dt_bias: torch.Tensor | None, initial_states: torch.Tensor | None) -> None:
    if not is_int_pow_2(chunk_size):
        raise ValueError(f"chunk_size ({chunk_size!r}) must be a positive integer power of 2")
    if cu_chunk_seqlens is None or last_chunk_indices is None or seq_idx is None:
        raise ValueError("cu_chunk_seqlens, last_chunk_indices and seq_idx are required (varlen input)")
    seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1], B.shape[2]
    problems = []
    if nheads % ngroups:
        problems.append(f"nheads ({nheads}) must be divisible by ngroups ({ngroups})")
    if B.shape != (seqlen, ngroups, dstate) or C.shape != B.shape:
        problems.append(f"B {tuple(B.shape)} and C {tuple(C.shape)} must be ({seqlen}, ngroups, dstate)")
    if dt.shape != (seqlen, nheads) or A.shape != (nheads,):
        problems.append(f"dt {tuple(dt.shape)} must be ({seqlen}, {nheads}) and A {tuple(A.shape)} ({nheads},)")
    if out.shape != x.shape or (z is not None and z.shape != x.shape):
        problems.append(f"out {tuple(out.shape)} and z must be shaped like x {tuple(x.shape)}")
    if D is not None and D.shape not in ((nheads, headdim), (nheads,)):
        problems.append(f"D {tuple(D.shape)} must be ({nheads}, {headdim}) or ({nheads},)")
    if dt_bias is not None and dt_bias.shape != (nheads,):
        problems.append(f"dt_bias {tuple(dt_bias.shape)} must be ({nheads},)")
    if seq_idx.shape != (cu_chunk_seqlens.shape[0] - 1,):
        problems.append(f"seq_idx {tuple(seq_idx.shape)} must have one entry per chunk "
                        f"({cu_chunk_seqlens.shape[0] - 1})")
    batch = last_chunk_indices.shape[0]
    if initial_states is not None and initial_states.shape != (batch, nheads, headdim, dstate):
        problems.append(f"initial_states {tuple(initial_states.shape)} must be ({batch}, {nheads}, {headdim}, "
                        f"{dstate})")
    if problems:
        raise ValueError("mamba_chunk_scan_combined_varlen: " + "; ".join(problems))


def mamba_chunk_scan_combined_varlen(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: int,
    cu_chunk_seqlens: torch.Tensor, last_chunk_indices: torch.Tensor, seq_idx: torch.Tensor, out: torch.Tensor,
    D: torch.Tensor | None = None, z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")), return_raw_states: bool = False,
    state_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan of packed sequences; ``y`` goes into ``out``, the final states are returned.

    Args:
        x: ``[seqlen, nheads, headdim]``; ``dt``: ``[seqlen, nheads]`` (``dt_bias`` ``[nheads]`` added, then
            softplus with ``dt_softplus``, then clamped to ``dt_limit``); ``A``: ``[nheads]``.
        B, C: ``[seqlen, ngroups, dstate]``.
        chunk_size: a power of two, at least every chunk's length.
        cu_chunk_seqlens: ``[nchunks + 1]`` chunk boundaries (a chunk never spans two sequences);
            ``last_chunk_indices``: ``[batch]``, each sequence's last chunk; ``seq_idx``: ``[nchunks]``, each
            chunk's sequence (``0 .. batch - 1``, in order).
        out: ``[seqlen, nheads, headdim]``, written in place (its dtype): ``(y + D x) * silu(z)``.
        D: ``[nheads]`` or ``[nheads, headdim]``; z: like ``x``; initial_states: ``[batch, nheads, headdim,
            dstate]`` (zeros when None).
        return_raw_states: also return the state after every chunk, ``[nchunks, nheads, headdim, dstate]``.
        state_dtype: dtype of the returned states (default ``C``'s).

    Returns:
        ``[batch, nheads, headdim, dstate]`` final states, or ``(final states, raw states)``.
    """
    _check(x, dt, A, B, C, chunk_size, cu_chunk_seqlens, last_chunk_indices, seq_idx, out, D, z, dt_bias,
           initial_states)
    dtype = state_dtype if state_dtype is not None else C.dtype
    if not return_raw_states and combined_triton_supported(x, B):
        return combined_scan_triton(x, dt, A, B, C, cu_chunk_seqlens, last_chunk_indices, out, D, z, dt_bias,
                                    initial_states, dt_softplus, dt_limit).to(dtype)
    dA_cumsum, dt_chunks = _chunk_cumsum_fwd(dt, A, chunk_size, cu_chunk_seqlens, dt_bias=dt_bias,
                                             dt_softplus=dt_softplus, dt_limit=dt_limit)
    own = _chunk_state_fwd(B, x, dt_chunks, dA_cumsum, cu_chunk_seqlens)
    dstate = B.shape[2]
    states = _state_passing_fwd(own.flatten(-2), dA_cumsum, cu_chunk_seqlens, seq_idx,
                                initial_states=initial_states.flatten(-2) if initial_states is not None else None,
                                out_dtype=dtype).unflatten(-1, (-1, dstate))
    cb = _bmm_chunk_fwd(C, B, chunk_size, cu_chunk_seqlens, output_dtype=torch.float32)
    _chunk_scan_fwd(cb, x, dt_chunks, dA_cumsum, C, states, cu_chunk_seqlens, out, seq_idx, D=D, z=z,
                    initial_states=initial_states)
    final = states[last_chunk_indices.to(device=states.device, dtype=torch.int64)]
    return (final, states) if return_raw_states else final
