"""Pure-PyTorch chunked selective-state-space scan (Mamba-2's state-space duality, SSD).

The recurrence per head is ``h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t B_t^T`` and
``y_t = h_t C_t + D * x_t``. The sequence is cut into chunks: inside a chunk the output is a
masked (decay-weighted) attention-like product; chunk-final states are carried across chunks by
a short sequential loop. Everything runs in fp32 on any device and is differentiable by autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["segment_sum", "ssd_chunk_scan"]


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(x[..., j+1 : i+1])`` for ``i >= j`` and ``-inf`` above the diagonal.

    Built by masked cumulative sums (not differences of one cumulative sum), so long chunks stay
    accurate; ``exp`` of it is the lower-triangular decay matrix of one chunk.
    """
    length = x.shape[-1]
    expanded = x.unsqueeze(-1).expand(*x.shape, length)  # expanded[..., k, j] = x[..., k]
    strict = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=-1)
    summed = torch.cumsum(expanded.masked_fill(~strict, 0.0), dim=-2)
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device))
    return summed.masked_fill(~keep, float("-inf"))


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run the SSD scan; returns ``y`` ``[b, l, h, p]`` (and the final state ``[b, h, p, n]``).

    Args:
        x: inputs ``[b, l, h, p]``.
        dt: positive step sizes ``[b, l, h]`` (after the bias and softplus).
        A: per-head decay rates ``[h]`` (negative).
        B, C: input and output projections ``[b, l, g, n]``; head ``i`` uses group ``i // (h // g)``.
        chunk_size: chunk length; ``l`` need not be a multiple of it.
        D: skip connection, ``[h]`` or ``[h, p]``.
        initial_state: state before the first token ``[b, h, p, n]`` (zeros when None).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size ({chunk_size}) must be positive")
    batch, length, heads, head_dim = x.shape
    groups, state_dim = B.shape[-2], B.shape[-1]
    if heads % groups != 0:
        raise ValueError(f"the number of heads ({heads}) must be divisible by the number of groups ({groups})")
    out_dtype = x.dtype
    xf, dtf, Af, Bf, Cf = (t.float() for t in (x, dt, A, B, C))
    per_group = heads // groups
    Bf = Bf.repeat_interleave(per_group, dim=2)  # [b, l, h, n]
    Cf = Cf.repeat_interleave(per_group, dim=2)

    pad = (-length) % chunk_size
    if pad:  # zero steps: no input, no decay; their outputs are dropped
        xf = F.pad(xf, (0, 0, 0, 0, 0, pad))
        dtf = F.pad(dtf, (0, 0, 0, pad))
        Bf = F.pad(Bf, (0, 0, 0, 0, 0, pad))
        Cf = F.pad(Cf, (0, 0, 0, 0, 0, pad))
    chunks = (length + pad) // chunk_size

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, chunks, chunk_size, *t.shape[2:])

    xc, dtc, Bc, Cc = split(xf), split(dtf), split(Bf), split(Cf)
    dA = (dtc * Af).permute(0, 3, 1, 2)  # [b, h, c, q]
    dA_cum = torch.cumsum(dA, dim=-1)
    x_dt = xc * dtc.unsqueeze(-1)  # [b, c, q, h, p]

    # Inside each chunk: y_i = sum_{j <= i} (C_i . B_j) * exp(sum dA_(j, i]) * dt_j x_j.
    decay = torch.exp(segment_sum(dA))  # [b, h, c, q(i), q(j)]
    scores = torch.einsum("bcihn,bcjhn->bhcij", Cc, Bc) * decay
    y = torch.einsum("bhcij,bcjhp->bcihp", scores, x_dt)

    # State each chunk contributes at its end, then carry the states across chunks.
    to_end = torch.exp(dA_cum[..., -1:] - dA_cum)  # [b, h, c, q]
    chunk_states = torch.einsum("bcjhn,bhcj,bcjhp->bchpn", Bc, to_end, x_dt)
    chunk_decay = torch.exp(dA_cum[..., -1])  # [b, h, c]
    state = (initial_state.float() if initial_state is not None
             else xf.new_zeros(batch, heads, head_dim, state_dim))
    entering = []
    for c in range(chunks):
        entering.append(state)
        state = state * chunk_decay[:, :, c, None, None] + chunk_states[:, c]
    prev = torch.stack(entering, dim=1)  # [b, c, h, p, n]: the state before each chunk

    # Contribution of the carried state: y_i += exp(sum dA_[0, i]) * C_i . state_before_chunk.
    y = y + torch.einsum("bcihn,bchpn,bhci->bcihp", Cc, prev, torch.exp(dA_cum))
    y = y.reshape(batch, chunks * chunk_size, heads, head_dim)[:, :length]
    if D is not None:
        Df = D.float()
        y = y + x.float() * (Df if Df.dim() == 2 else Df[:, None])
    y = y.to(out_dtype)
    return (y, state) if return_final_state else y
