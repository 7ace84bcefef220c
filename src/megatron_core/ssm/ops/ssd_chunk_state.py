"""The per-chunk pieces of the varlen SSD scan (Megatron-Core 0.19's ``ssm.ops.ssd_chunk_state``), in PyTorch.

``_chunk_cumsum_fwd``: each chunk's step sizes (``dt + dt_bias``, softplus, clamped to ``dt_limit``; zero on
padding) and the running sum of ``dt * A`` inside the chunk, both ``[nheads, nchunks, chunk_size]`` fp32.
``_chunk_state_fwd``: the state each chunk alone contributes at its end, ``sum_j exp(dA_last - dA_j) dt_j x_j B_j^T``
``[nchunks, nheads, headdim, dstate]``. :func:`chunk_state_varlen`: every sequence's final state from the states
entering the chunks (sequences may share chunks). fp32 math on every device; chunks are laid out by
:mod:`~megatron_core.ssm.ops.chunk_layout`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.ssm.ops.chunk_layout import chunk_positions, gather_chunks

__all__ = ["chunk_state_varlen"]


def _heads_of_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """``[..., ngroups, n]`` -> ``[..., nheads, n]``: head ``h`` reads group ``h // (nheads // ngroups)``."""
    return t.repeat_interleave(nheads // t.shape[-2], dim=-2)


def _chunk_cumsum_fwd(dt: torch.Tensor, A: torch.Tensor, chunk_size: int, cu_chunk_seqlens: torch.Tensor,
                      dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                      dt_limit: tuple[float, float] = (0.0, float("inf"))) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dA_cumsum, dt_out)``, both ``[nheads, nchunks, chunk_size]`` fp32, from ``dt`` ``[seqlen, nheads]``."""
    seqlen, nheads = dt.shape
    if A.shape != (nheads,) or (dt_bias is not None and dt_bias.shape != (nheads,)):
        raise ValueError(f"A {tuple(A.shape)} and dt_bias must be ({nheads},) for dt {tuple(dt.shape)}")
    positions, valid = chunk_positions(cu_chunk_seqlens, chunk_size, seqlen, dt.device)
    step = gather_chunks(dt, positions, valid)  # [nchunks, chunk_size, nheads]; padding reads 0
    if dt_bias is not None:
        step = step + dt_bias.float()
    if dt_softplus:
        step = F.softplus(step, threshold=20.0)
    step = step.clamp(dt_limit[0], dt_limit[1]).masked_fill(~valid[..., None], 0.0)
    dt_out = step.permute(2, 0, 1).contiguous()
    return torch.cumsum(dt_out * A.float()[:, None, None], dim=-1), dt_out


def _chunk_state_fwd(B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor,
                     cu_chunk_seqlens: torch.Tensor, states: torch.Tensor | None = None,
                     states_in_fp32: bool = True) -> torch.Tensor:
    """The state each chunk contributes from zero at its end, ``[nchunks, nheads, headdim, dstate]`` (into
    ``states`` when given; else fp32, or ``B``'s dtype without ``states_in_fp32``)."""
    seqlen, nheads, headdim = x.shape
    _, nchunks, chunk_size = dt.shape
    positions, valid = chunk_positions(cu_chunk_seqlens, chunk_size, seqlen, x.device)
    xc = gather_chunks(x, positions, valid)  # [c, q, h, p]
    Bc = _heads_of_groups(gather_chunks(B, positions, valid), nheads)  # [c, q, h, n]
    scale = torch.exp(torch.clamp(dA_cumsum[..., -1:] - dA_cumsum, max=0.0)) * dt  # [h, c, q]
    result = torch.einsum("hcq,cqhp,cqhn->chpn", scale, xc, Bc)
    if states is not None:
        return states.copy_(result)
    return result.to(torch.float32 if states_in_fp32 else B.dtype)


def chunk_state_varlen(B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor,
                       cu_seqlens: torch.Tensor, chunk_states: torch.Tensor,
                       initial_states: torch.Tensor | None = None, last_chunk_indices: torch.Tensor | None = None,
                       cu_chunk_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Each sequence's final SSM state, ``[batch, nheads, headdim, dstate]`` in ``chunk_states``' dtype.

    ``B`` ``[total, ngroups, dstate]``, ``x`` ``[total, nheads, headdim]``, ``dt`` / ``dA_cumsum``
    ``[nheads, nchunks, chunk_size]`` (from ``_chunk_cumsum_fwd``), ``cu_seqlens`` ``[batch + 1]``,
    ``chunk_states`` ``[nchunks, nheads, headdim, dstate]``: the state entering each chunk (of the sequence running
    at its start). A sequence's last chunk is ``last_chunk_indices[b]`` of ``cu_chunk_seqlens`` when both are given,
    else chunk ``(end - 1) // chunk_size`` of fixed-size chunks. Its final state is that chunk's tokens of the
    sequence folded into the state entering the chunk (when the sequence began before it) or into
    ``initial_states[b]`` (zeros when None) decayed over the chunk's tokens before the sequence's start.
    """
    total, nheads, headdim = x.shape
    _, nchunks, chunk_size = dt.shape
    batch = cu_seqlens.shape[0] - 1
    if B.shape[0] != total or nheads % B.shape[1] or dA_cumsum.shape != dt.shape or \
            chunk_states.shape != (nchunks, nheads, headdim, B.shape[2]):
        raise ValueError(f"chunk_state_varlen: B {tuple(B.shape)}, x {tuple(x.shape)}, dt {tuple(dt.shape)}, "
                         f"dA_cumsum {tuple(dA_cumsum.shape)} and chunk_states {tuple(chunk_states.shape)} disagree")
    if initial_states is not None and initial_states.shape != (batch, *chunk_states.shape[1:]):
        raise ValueError(f"chunk_state_varlen: initial_states {tuple(initial_states.shape)} must be "
                         f"{(batch, *chunk_states.shape[1:])}")
    device = x.device
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    start, end = cu[:-1], cu[1:]
    if last_chunk_indices is not None and cu_chunk_seqlens is not None:
        chunk = last_chunk_indices.to(device=device, dtype=torch.int64)
        cu_chunks = cu_chunk_seqlens.to(device=device, dtype=torch.int64)
        chunk_start, limit = cu_chunks[chunk], cu_chunks[chunk + 1] - cu_chunks[chunk]
    else:
        chunk = torch.div(end - 1, chunk_size, rounding_mode="floor")
        chunk_start = chunk * chunk_size
        limit = end - chunk_start
    offsets = torch.arange(chunk_size, device=device)
    first = torch.clamp(start - chunk_start, min=0)
    keep = (offsets >= first[:, None]) & (offsets < limit[:, None])  # [batch, q]
    tokens = (chunk_start[:, None] + offsets).clamp(0, max(total - 1, 0))
    xs = x.float()[tokens] * keep[..., None, None]  # [batch, q, h, p]
    Bs = _heads_of_groups(B.float()[tokens], nheads) * keep[..., None, None]  # [batch, q, h, n]
    dA = dA_cumsum.float()[:, chunk].permute(1, 0, 2)  # [batch, h, q]
    dA_last = dA.gather(2, (end - 1 - chunk_start).clamp(0, chunk_size - 1)[:, None, None].expand(-1, nheads, 1))
    scale = torch.exp(torch.clamp(dA_last - dA, max=0.0)) * dt.float()[:, chunk].permute(1, 0, 2) * keep[:, None]
    acc = torch.einsum("bhq,bqhp,bqhn->bhpn", scale, xs, Bs)
    began_before = (start < chunk_start)[:, None, None, None]
    entering = chunk_states.float()[chunk]
    if initial_states is None:
        past, boundary = torch.where(began_before, entering, torch.zeros_like(entering)), torch.zeros_like(dA_last)
    else:
        past = torch.where(began_before, entering, initial_states.float())
        inside = (start > chunk_start)[:, None, None]
        before = dA.gather(2, (start - chunk_start - 1).clamp(0, chunk_size - 1)[:, None, None].expand(-1, nheads, 1))
        boundary = torch.where(inside & ~began_before[..., 0], before, torch.zeros_like(before))
    acc = acc + past * torch.exp(torch.clamp(dA_last - boundary, max=0.0))[..., None]
    return acc.to(chunk_states.dtype)
