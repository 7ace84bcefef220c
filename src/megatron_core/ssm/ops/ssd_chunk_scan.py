"""The output pass of the varlen SSD scan (Megatron-Core 0.19's ``ssm.ops.ssd_chunk_scan``), in PyTorch.

``_chunk_scan_fwd`` writes, for every token ``i`` of chunk ``c``,
``y_i = exp(dA_i) C_i . state_before(c) + sum_{j <= i} (C_i . B_j) exp(dA_i - dA_j) dt_j x_j + D x_i``, times
``silu(z_i)`` when ``z`` is given, into ``out`` (in place). ``state_before(c)`` is the previous chunk's final state,
or at a sequence's first chunk its initial state (zeros without ``initial_states``). fp32 math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.ssm.ops.chunk_layout import chunk_positions, gather_chunks

__all__: list[str] = []


def _states_before(states: torch.Tensor, seq_idx: torch.Tensor,
                   initial_states: torch.Tensor | None) -> torch.Tensor:
    """``[nchunks, nheads, headdim, dstate]`` fp32: the state each chunk starts from."""
    seq = seq_idx.to(device=states.device, dtype=torch.int64)
    starts = torch.ones_like(seq, dtype=torch.bool)
    starts[1:] = seq[1:] != seq[:-1]
    carried = torch.cat([states.new_zeros(1, *states.shape[1:]), states[:-1]]).float()
    fresh = initial_states.float()[seq] if initial_states is not None else torch.zeros_like(carried)
    return torch.where(starts[:, None, None, None], fresh, carried)


def _chunk_scan_fwd(cb: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor, C: torch.Tensor,
                    states: torch.Tensor, cu_chunk_seqlens: torch.Tensor, out: torch.Tensor, seq_idx: torch.Tensor,
                    D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                    initial_states: torch.Tensor | None = None) -> None:
    """Write the scan's output into ``out`` ``[seqlen, nheads, headdim]`` (its dtype).

    ``cb`` ``[nchunks, ngroups, chunk_size, chunk_size]`` (``_bmm_chunk_fwd(C, B)``), ``x`` ``[seqlen, nheads,
    headdim]``, ``dt``/``dA_cumsum`` ``[nheads, nchunks, chunk_size]``, ``C`` ``[seqlen, ngroups, dstate]``,
    ``states`` ``[nchunks, nheads, headdim, dstate]`` (after each chunk), ``seq_idx`` ``[nchunks]``, ``D`` ``[nheads]``
    or ``[nheads, headdim]``, ``z`` like ``x``, ``initial_states`` ``[batch, nheads, headdim, dstate]``. Tokens in no
    chunk are left as they are.
    """
    seqlen, nheads, headdim = x.shape
    _, nchunks, chunk_size = dt.shape
    ngroups = C.shape[1]
    if cb.shape != (nchunks, ngroups, chunk_size, chunk_size) or states.shape[:3] != (nchunks, nheads, headdim) \
            or seq_idx.shape != (nchunks,) or nheads % ngroups:
        raise ValueError(f"_chunk_scan_fwd: cb {tuple(cb.shape)}, states {tuple(states.shape)}, seq_idx "
                         f"{tuple(seq_idx.shape)} disagree with x {tuple(x.shape)}, dt {tuple(dt.shape)}, "
                         f"C {tuple(C.shape)}")
    positions, valid = chunk_positions(cu_chunk_seqlens, chunk_size, seqlen, x.device)
    xc = gather_chunks(x, positions, valid)  # [c, q, h, p]
    Cc = gather_chunks(C, positions, valid).repeat_interleave(nheads // ngroups, dim=2)  # [c, q, h, n]
    dA = dA_cumsum.float().permute(1, 0, 2)  # [c, h, q]
    prev = _states_before(states, seq_idx, initial_states)
    y = torch.einsum("cqhn,chpn->cqhp", Cc, prev) * torch.exp(dA).permute(0, 2, 1)[..., None]
    causal = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device))
    decay = torch.exp(torch.clamp(dA[..., :, None] - dA[..., None, :], max=0.0))  # [c, h, i, j]
    weights = cb.float().repeat_interleave(nheads // ngroups, dim=1) * decay * dt.float().permute(1, 0, 2)[:, :, None]
    y = y + torch.einsum("chij,cjhp->cihp", weights.masked_fill(~causal, 0.0), xc)
    if D is not None:
        Df = D.float()
        y = y + xc * (Df if Df.dim() == 2 else Df[:, None])
    if z is not None:
        y = y * F.silu(gather_chunks(z, positions, valid))
    rows = positions[valid]
    out.index_copy_(0, rows, y[valid].to(out.dtype))
