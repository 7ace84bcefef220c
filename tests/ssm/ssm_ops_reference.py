"""Independent references for tests/ssm/test_ssm_ops*.py: the Mamba-2 recurrence token by token in float64, and
packed-batch builders (sequences cut into chunks the way Megatron-Core 0.19's varlen ops take them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def recurrence(x, dt, A, B, C, D=None, z=None, state=None):
    """One sequence, token by token, float64: ``x`` ``[L, h, p]``, ``dt`` ``[L, h]`` (final step sizes), ``A``
    ``[h]``, ``B``/``C`` ``[L, g, n]``; returns ``(y [L, h, p], states after each token [L, h, p, n])``."""
    length, heads, head_dim = x.shape
    groups, n = B.shape[1], B.shape[2]
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    h = torch.zeros(heads, head_dim, n, dtype=torch.float64) if state is None else state.double().clone()
    ys, states = [], []
    for t in range(length):
        for head in range(heads):
            g = head // (heads // groups)
            h[head] = torch.exp(dt[t, head] * A[head]) * h[head] + dt[t, head] * torch.outer(x[t, head], B[t, g])
        y = torch.stack([h[head] @ C[t, head // (heads // groups)] for head in range(heads)])
        if D is not None:
            Dd = D.double()
            y = y + x[t] * (Dd if Dd.dim() == 2 else Dd[:, None])
        if z is not None:
            y = y * F.silu(z[t].double())
        ys.append(y)
        states.append(h.clone())
    return torch.stack(ys), torch.stack(states)


def pack(lengths, chunk_size, first_offsets=None):
    """``(cu_seqlens, cu_chunk_seqlens, seq_idx, last_chunk_indices)`` of sequences of ``lengths`` packed back to
    back, each cut into chunks of ``chunk_size`` after a first chunk of ``chunk_size - offset`` tokens (as a
    sequence resumed mid-chunk in chunked prefill)."""
    first_offsets = first_offsets or [0] * len(lengths)
    cu, chunks, seq_idx, last = [0], [0], [], []
    for s, (length, offset) in enumerate(zip(lengths, first_offsets)):
        done = 0
        while done < length:
            take = min(length - done, chunk_size - (offset if done == 0 else 0))
            done += take
            chunks.append(chunks[-1] + take)
            seq_idx.append(s)
        last.append(len(seq_idx) - 1)
        cu.append(cu[-1] + length)
    as_t = lambda v, dtype=torch.int32: torch.tensor(v, dtype=dtype)  # noqa: E731
    return as_t(cu), as_t(chunks), as_t(seq_idx), as_t(last, torch.int64)


def conv_reference(x, weight, bias, history):
    """One sequence through ``silu(causal depthwise conv)`` with ``F.conv1d`` in float64: ``x`` ``[L, d]``,
    ``weight`` ``[d, K]``, ``history`` ``[d, K - 1]`` (the inputs before it); ``[L, d]``."""
    width = weight.shape[1]
    full = torch.cat([history.double(), x.double().t()], dim=1)[None]  # [1, d, K - 1 + L]
    out = F.conv1d(full, weight.double()[:, None], bias.double() if bias is not None else None,
                   groups=weight.shape[0])
    assert out.shape[-1] == x.shape[0] and width >= 1
    return F.silu(out[0].t())


def rel(got, want):
    """``||got - want|| / ||want||``."""
    return ((got.double().cpu() - want.double().cpu()).norm() / want.double().cpu().norm().clamp(min=1e-30)).item()
