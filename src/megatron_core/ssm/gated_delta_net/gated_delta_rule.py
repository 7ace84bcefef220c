"""The gated delta rule in pure PyTorch, computed chunk by chunk (Megatron-Core's ``torch_chunk_gated_delta_rule``).

Per head, with a state ``S`` of shape ``[d_k, d_v]`` and, at each step ``t``, a log-decay ``g_t <= 0`` and a write
strength ``beta_t``::

    S <- exp(g_t) * S
    S <- S + beta_t * k_t (v_t - S^T k_t)^T
    o_t = scale * S^T q_t

Inside a chunk of ``C`` steps the writes ``u = beta * (v - prediction)`` solve one unit lower-triangular system
(the WY form), so a chunk costs a few ``C x C`` matrix products; only the state is carried from chunk to chunk.
This is the CPU path of :class:`~megatron_core.ssm.gated_delta_net.GatedDeltaNet` and the reference for the
optional flash-linear-attention kernel. Layouts are flash-linear-attention's: ``[b, s, heads, dim]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["l2norm", "torch_chunk_gated_delta_rule"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2, dim) + eps)`` (flash-linear-attention's ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  chunk_size: int) -> None:
    if chunk_size <= 0:
        raise ValueError(f"torch_chunk_gated_delta_rule: chunk_size ({chunk_size}) must be positive")
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"torch_chunk_gated_delta_rule: q {tuple(q.shape)} and k {tuple(k.shape)} must both be "
                         "[b, s, heads, d_k]")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2] or v.shape[2] % q.shape[2] != 0:
        raise ValueError(f"torch_chunk_gated_delta_rule: v {tuple(v.shape)} must be [b, s, v_heads, d_v] with "
                         f"v_heads a multiple of the key heads ({q.shape[2]})")
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise ValueError(f"torch_chunk_gated_delta_rule: g {tuple(g.shape)} and beta {tuple(beta.shape)} must "
                         f"be [b, s, v_heads] = {tuple(v.shape[:3])}")


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule on ``[b, h, s, d]`` inputs (``s`` a multiple of ``chunk_size``, q already scaled) from ``state``
    ``[b, h, d_k, d_v]``; returns the outputs ``[b, h, s, d_v]`` and the final state."""
    b, h, s, d_k = k.shape
    n = s // chunk_size
    q, k, v = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g = g.reshape(b, h, n, chunk_size).cumsum(-1)  # decay from the chunk start, inclusive
    beta = beta.reshape(b, h, n, chunk_size, 1)
    steps = torch.arange(chunk_size, device=k.device)
    causal = steps[:, None] >= steps[None, :]  # j <= i
    # decay[i, j] = exp(G_i - G_j) for j <= i, else 0 (masked before exp: the upper part could overflow)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # (I + A) u = beta * (v - exp(G) k S0), A[i, j] = beta_i exp(G_i - G_j) k_i . k_j for j < i
    system = torch.eye(chunk_size, dtype=k.dtype, device=k.device) + (
        beta * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([beta * v, beta * g.exp()[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    w_v, w_k = solved.split([v.shape[-1], d_k], dim=-1)  # u = w_v - w_k S0
    scores = (q @ k.transpose(-1, -2)) * decay  # [.., C, C], causal inclusive
    outputs = []
    for c in range(n):
        u = w_v[:, :, c] - w_k[:, :, c] @ state
        g_c = g[:, :, c]
        outputs.append((q[:, :, c] * g_c.exp()[..., None]) @ state + scores[:, :, c] @ u)
        tail = (g_c[..., -1:] - g_c).exp()[..., None]  # exp(G_C - G_j)
        state = state * g_c[..., -1:, None].exp() + (k[:, :, c] * tail).transpose(-1, -2) @ u
    return torch.stack(outputs, dim=2).reshape(b, h, s, -1), state


def _one_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  chunk_size: int, initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, s, h, d]`` inputs in the compute dtype -> outputs ``[b, s, h, d_v]`` and final state."""
    b, s, h, _ = v.shape
    if k.shape[2] != h:
        q, k = (x.repeat_interleave(h // k.shape[2], dim=2) for x in (q, k))
    pad = (-s) % chunk_size
    # Padded steps have beta = 0, g = 0 and k = 0: they neither write nor decay the state.
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)) for x in (g, beta))
    state = (torch.zeros(b, h, k.shape[-1], v.shape[-1], dtype=v.dtype, device=v.device)
             if initial_state is None else initial_state.to(v.dtype))
    if s == 0:  # an empty packed document: no output, the state passes through
        return v.new_zeros(b, 0, h, v.shape[-1]), state
    out, state = _chunked(q, k, v, g, beta, state, chunk_size)
    return out[:, :, :s].transpose(1, 2), state


def torch_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over ``[b, s, heads, dim]`` inputs; returns ``(o [b, s, v_heads, d_v], final_state)``.

    ``q``, ``k``: ``[b, s, h_k, d_k]`` (each key head serves ``v_heads / h_k`` consecutive value heads); ``v``:
    ``[b, s, v_heads, d_v]``; ``g`` (log-decay, <= 0) and ``beta``: ``[b, s, v_heads]``. ``initial_state`` and the
    final state (returned with ``output_final_state``, else None) are ``[N, v_heads, d_k, d_v]`` in fp32, ``N`` the
    batch or, with ``cu_seqlens`` (packed sequences, ``b == 1``), the number of sequences, each of which starts from
    its own state. ``scale`` defaults to ``d_k ** -0.5``. Computed in fp32 (fp64 inputs stay fp64); the output has
    ``q``'s dtype.
    """
    _check_inputs(q, k, v, g, beta, chunk_size)
    out_dtype = q.dtype
    compute = torch.promote_types(q.dtype, torch.float32)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.to(compute)), l2norm(k.to(compute))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(compute) for x in (q, k, v, g, beta))
    q = q * scale
    if cu_seqlens is None:
        out, state = _one_sequence(q, k, v, g, beta, chunk_size, initial_state)
        return out.to(out_dtype), (state if output_final_state else None)
    if q.shape[0] != 1:
        raise ValueError(f"torch_chunk_gated_delta_rule: packed sequences (cu_seqlens) need batch 1, got {q.shape[0]}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != q.shape[1] or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"torch_chunk_gated_delta_rule: cu_seqlens {bounds} must rise from 0 to the sequence "
                         f"length ({q.shape[1]})")
    outs, states = [], []
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        init = None if initial_state is None else initial_state[i:i + 1]
        part = slice(start, end)
        out, state = _one_sequence(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], chunk_size, init)
        outs.append(out)
        states.append(state)
    final = torch.cat(states, dim=0) if output_final_state else None
    return torch.cat(outs, dim=1).to(out_dtype), final
