"""The CUDA path of :func:`~megatron_core.ssm.ops.ssd_combined.mamba_chunk_scan_combined_varlen`: the packed
sequences laid out as one padded batch ``[batch, longest, ...]`` and scanned by one call of the Triton SSD forward
(:func:`megatron_core.ssm.ssd_scan_triton.ssd_chunk_scan_triton`) from their initial states.

Padding rows get ``dt = 0`` (no decay, no input), so each sequence's final state is its last token's. The layout is
built on the host from ``cu_chunk_seqlens`` and ``last_chunk_indices`` (one device-to-host copy: not for CUDA-graph
capture). The chunking of the call is the kernels' own; the SSD result does not depend on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.ssm.ssd_scan_triton import ssd_chunk_scan_triton, ssd_scan_triton_supported

__all__ = ["combined_scan_triton", "combined_triton_supported"]

_MAX_DIM = 256  # the Triton scan's largest head_dim and d_state


def combined_triton_supported(x: torch.Tensor, B: torch.Tensor) -> bool:
    """Whether the Triton scan serves ``x`` ``[seqlen, nheads, headdim]`` and ``B`` ``[seqlen, ngroups, dstate]``."""
    return B.shape[-1] <= _MAX_DIM and ssd_scan_triton_supported(x, None, True)


def _sequence_layout(cu_chunk_seqlens: torch.Tensor, last_chunk_indices: torch.Tensor, pad_row: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """``(gather [S * L], valid [S, L], dest [rows], S, L)``: each batch position's token (``pad_row`` on padding),
    whether it is real, and the token of each real position in batch order."""
    cu, last = cu_chunk_seqlens.tolist(), last_chunk_indices.tolist()
    spans = [(cu[last[s - 1] + 1] if s else cu[0], cu[c + 1]) for s, c in enumerate(last)]
    longest = max([end - start for start, end in spans] + [1])
    gather, valid, dest = [], [], []
    for start, end in spans:
        count = end - start
        gather += list(range(start, end)) + [pad_row] * (longest - count)
        valid += [1.0] * count + [0.0] * (longest - count)
        dest += range(start, end)
    as_long = [torch.tensor(v, dtype=torch.long, device=device) for v in (gather, dest)]
    mask = torch.tensor(valid, dtype=torch.float32, device=device).view(len(spans), longest)
    return as_long[0], mask, as_long[1], len(spans), longest


def combined_scan_triton(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                         cu_chunk_seqlens: torch.Tensor, last_chunk_indices: torch.Tensor, out: torch.Tensor,
                         D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                         initial_states: torch.Tensor | None, dt_softplus: bool,
                         dt_limit: tuple[float, float]) -> torch.Tensor:
    """Write ``(y + D x) * silu(z)`` into ``out`` and return the final states ``[batch, h, p, n]`` (fp32)."""
    seqlen = x.shape[0]
    gather, valid, dest, S, L = _sequence_layout(cu_chunk_seqlens, last_chunk_indices, seqlen, x.device)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(1, *t.shape[1:])]).index_select(0, gather).view(S, L, *t.shape[1:])

    step = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        step = F.softplus(step, threshold=20.0)
    step = padded(step.clamp(dt_limit[0], dt_limit[1])) * valid[..., None]
    y, final = ssd_chunk_scan_triton(padded(x), step, A, padded(B), padded(C), D,
                                     initial_state=initial_states, return_final_state=True)
    flat = y.reshape(S * L, *x.shape[1:])[valid.view(-1) > 0]
    if z is not None:
        flat = (flat.float() * F.silu(z.index_select(0, dest).float()))
    out.index_copy_(0, dest, flat.to(out.dtype))
    return final
