"""The SSM's decode step over state slots (Megatron-Core 0.19's ``ssm.ops.mamba_ssm``).

:func:`selective_state_update` advances each row's state ``[nheads, dim, dstate]`` by its new tokens, in place:
``dt = softplus(dt + dt_bias)`` (with ``dt_softplus``), ``h = exp(A dt) h + dt x B^T``, ``y = h C + D x``, times
``silu(z)`` when ``z`` is given. Rows name their slot (``state_batch_indices``; negative: a padding row, output
zeros, no state touched); ``intermediate_ssm_states[slot, s]`` receives the state after token ``s``.

On CUDA with Triton one kernel does it (ours: one program per ``(block of dim, row, head)``, fp32 running state
stored once after the row's tokens, decays through :func:`fast_exp`); elsewhere PyTorch in fp32. ``fast_exp`` (a
Triton ``@jit`` function: ``exp(x)`` as ``exp2(x log2 e)``) is built on first access (``AttributeError`` without
Triton); Triton is loaded through :mod:`megatron_core.jit` only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core.jit import have_triton, kernel_device, next_power_of_two, triton_modules

# ``fast_exp`` is provided by ``__getattr__`` (it needs Triton), so it is not in ``__all__``.
__all__ = ["selective_state_update"]

_MAX_DSTATE = 256


def __getattr__(name: str) -> Any:
    if name == "fast_exp":
        if not have_triton():
            raise AttributeError("fast_exp needs Triton, which is not installed")
        _kernel()
        return globals()["fast_exp"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()
    # Triton finds a kernel's helper functions among its module's globals, not in a closure.
    global fast_exp

    @triton.jit
    def fast_exp(x):
        """``exp(x)`` as ``exp2(x * log2(e))``."""
        return tl.math.exp2(1.4426950408889634 * x)

    @triton.jit
    def selective_state_update_kernel(
            state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, out_ptr, idx_ptr, int_ptr,
            seq_len, dim, dstate, heads_per_group,
            s_st_b, s_st_h, s_st_m, s_x_b, s_x_s, s_x_h, s_dt_b, s_dt_s, s_dt_h, s_dt_m, s_bias_h, s_bias_m,
            s_A_h, s_A_m, s_A_n, s_B_b, s_B_s, s_B_g, s_C_b, s_C_s, s_C_g, s_D_h, s_z_b, s_z_s, s_z_h,
            s_o_b, s_o_s, s_o_h, s_i_b, s_i_s, s_i_h, s_i_m,
            BM: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr,
            HAS_Z: tl.constexpr, HAS_IDX: tl.constexpr, HAS_INT: tl.constexpr):
        """One row's ``seq_len`` tokens through one head's ``[BM, dstate]`` state tile."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        b = tl.program_id(1).to(tl.int64)
        h = tl.program_id(2)
        g = h // heads_per_group
        ns = tl.arange(0, BN)
        m_ok = rows < dim
        n_ok = ns < dstate
        tile_ok = m_ok[:, None] & n_ok[None, :]
        out_base = out_ptr + b * s_o_b + h * s_o_h + rows
        if HAS_IDX:
            slot = tl.load(idx_ptr + b).to(tl.int64)
        else:
            slot = b
        if slot < 0:  # a padding row
            for s in range(seq_len):
                tl.store(out_base + s * s_o_s, tl.zeros([BM], dtype=tl.float32), mask=m_ok)
            return
        st_ptrs = state_ptr + slot * s_st_b + h * s_st_h + rows[:, None] * s_st_m + ns[None, :]
        state = tl.load(st_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
        A = tl.load(A_ptr + h * s_A_h + rows[:, None] * s_A_m + ns[None, :] * s_A_n, mask=tile_ok,
                    other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(dt_bias_ptr + h * s_bias_h + rows * s_bias_m, mask=m_ok, other=0.0).to(tl.float32)
        if HAS_D:
            D = tl.load(D_ptr + h * s_D_h + rows, mask=m_ok, other=0.0).to(tl.float32)
        for s in range(seq_len):
            x = tl.load(x_ptr + b * s_x_b + s * s_x_s + h * s_x_h + rows, mask=m_ok, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + b * s_dt_b + s * s_dt_s + h * s_dt_h + rows * s_dt_m, mask=m_ok,
                         other=0.0).to(tl.float32)
            if HAS_BIAS:
                dt = dt + bias
            if SOFTPLUS:
                dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
            Bv = tl.load(B_ptr + b * s_B_b + s * s_B_s + g * s_B_g + ns, mask=n_ok, other=0.0).to(tl.float32)
            Cv = tl.load(C_ptr + b * s_C_b + s * s_C_s + g * s_C_g + ns, mask=n_ok, other=0.0).to(tl.float32)
            state = state * fast_exp(A * dt[:, None]) + (dt * x)[:, None] * Bv[None, :]
            if HAS_INT:
                tl.store(int_ptr + slot * s_i_b + s * s_i_s + h * s_i_h + rows[:, None] * s_i_m + ns[None, :],
                         state.to(int_ptr.dtype.element_ty), mask=tile_ok)
            y = tl.sum(state * Cv[None, :], 1)
            if HAS_D:
                y = y + D * x
            if HAS_Z:
                zv = tl.load(z_ptr + b * s_z_b + s * s_z_s + h * s_z_h + rows, mask=m_ok, other=0.0).to(tl.float32)
                y = y * zv / (1.0 + tl.exp(-zv))
            tl.store(out_base + s * s_o_s, y.to(out_ptr.dtype.element_ty), mask=m_ok)
        tl.store(st_ptrs, state.to(state_ptr.dtype.element_ty), mask=tile_ok)

    return selective_state_update_kernel


def _per_head(t: torch.Tensor | None, nheads: int, dim: int) -> torch.Tensor | None:
    """``[dim]`` (shared by the heads) or ``[nheads, dim]`` -> ``[nheads, dim]`` (a view)."""
    if t is None:
        return None
    return t.unsqueeze(0).expand(nheads, dim) if t.dim() == 1 else t


def _update_torch(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                  softplus: bool, indices: torch.Tensor | None, intermediate: torch.Tensor | None) -> torch.Tensor:
    """The recurrence in fp32 on the standardised shapes (``x`` ``[b, s, h, dim]``, ``state`` ``[slots, h, dim, n]``)."""
    batch, seq_len, nheads, _ = x.shape
    out = torch.zeros_like(x)
    rows = torch.arange(batch, device=x.device)
    slots = rows if indices is None else indices.to(device=x.device, dtype=torch.int64)
    real = (slots >= 0).nonzero().squeeze(1)
    rows, slots = rows[real], slots[real]
    per_group = nheads // B.shape[2]
    h = state[slots].float()
    Af = A.float()
    for s in range(seq_len):
        xs, step = x[rows, s].float(), dt[rows, s].float()
        if dt_bias is not None:
            step = step + dt_bias.float()
        if softplus:
            step = F.softplus(step, threshold=20.0)
        Bs = B[rows, s].float().repeat_interleave(per_group, dim=1)[:, :, None, :]  # [rows, h, 1, n]
        Cs = C[rows, s].float().repeat_interleave(per_group, dim=1)[:, :, None, :]
        h = h * torch.exp(Af * step[..., None]) + (step * xs)[..., None] * Bs
        if intermediate is not None:
            intermediate[slots, s] = h.to(intermediate.dtype)
        y = (h * Cs).sum(-1)
        if D is not None:
            y = y + D.float() * xs
        if z is not None:
            y = y * F.silu(z[rows, s].float())
        out[rows, s] = y.to(out.dtype)
    state[slots] = h.to(state.dtype)
    return out


def _unit_last(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _update_triton(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
                   softplus: bool, indices: torch.Tensor | None, intermediate: torch.Tensor | None) -> torch.Tensor:
    """The kernel's launch on the standardised shapes (CUDA tensors, or CPU ones under Triton's interpreter)."""
    x, B, C, z, D = (_unit_last(t) for t in (x, B, C, z, D))
    batch, seq_len, nheads, dim = x.shape
    dstate = state.shape[-1]
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if batch == 0 or seq_len == 0:
        return out
    if state.stride(-1) != 1 or (intermediate is not None and intermediate.stride(-1) != 1):
        raise ValueError("selective_state_update: state and intermediate_ssm_states need a unit last stride")
    # Fewer rows per program for wider states, so that the fp32 state tile stays in registers.
    block_m = 32 if dstate <= 16 else 16 if dstate <= 32 else 8 if dstate <= 64 else 4
    zeros4 = (0, 0, 0, 0)
    with kernel_device(x):
        _kernel()[(-(-dim // block_m), batch, nheads)](
            state, x, dt, dt_bias if dt_bias is not None else x, A, B, C, D if D is not None else x,
            z if z is not None else x, out, indices if indices is not None else x,
            intermediate if intermediate is not None else state, seq_len, dim, dstate, nheads // B.shape[2],
            *state.stride()[:3], *x.stride()[:3], *dt.stride(), *(dt_bias.stride() if dt_bias is not None else (0, 0)),
            *A.stride(), *B.stride()[:3], *C.stride()[:3], D.stride(0) if D is not None else 0,
            *(z.stride()[:3] if z is not None else (0, 0, 0)), *out.stride()[:3],
            *(intermediate.stride()[:4] if intermediate is not None else zeros4),
            BM=block_m, BN=next_power_of_two(dstate), HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(softplus),
            HAS_D=D is not None, HAS_Z=z is not None, HAS_IDX=indices is not None, HAS_INT=intermediate is not None,
            num_warps=4)
    return out


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                           z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                           dt_softplus: bool = False, state_batch_indices: torch.Tensor | None = None,
                           intermediate_ssm_states: torch.Tensor | None = None) -> torch.Tensor:
    """Advance the SSM states by ``x``'s tokens (in place) and return ``y``, shaped and typed like ``x``.

    Args:
        state: ``[slots, dim, dstate]`` or ``[slots, nheads, dim, dstate]``.
        x: ``[batch, dim]``, ``[batch, seqlen, dim]`` (state without heads), ``[batch, nheads, dim]`` or
            ``[batch, seqlen, nheads, dim]`` (state with heads); ``dt`` and ``z`` match it (``dt`` may be an
            expanded view, e.g. one value per head repeated over ``dim``).
        A: ``[dim, dstate]`` or ``[nheads, dim, dstate]`` (any strides).
        B, C: ``[batch, dstate]``, ``[batch, seqlen, dstate]``, ``[batch, ngroups, dstate]`` or
            ``[batch, seqlen, ngroups, dstate]`` (head ``h`` reads group ``h // (nheads // ngroups)``).
        D, dt_bias: ``[dim]`` or ``[nheads, dim]``.
        state_batch_indices: ``[batch]`` slots of the rows (row ``b`` uses slot ``b`` when None); negative: padding.
        intermediate_ssm_states: ``[slots, seqlen, nheads, dim, dstate]`` (or without ``nheads``): the state after
            each token, by slot.
    """
    has_heads = state.dim() == 4
    state4 = state if has_heads else state.unsqueeze(1)
    no_seq = x.dim() == (3 if has_heads else 2)

    def standard(t: torch.Tensor | None) -> torch.Tensor | None:
        """To ``[batch, seqlen, heads or groups, last]``."""
        if t is None:
            return None
        t = t.unsqueeze(1) if no_seq else t
        return t if has_heads else t.unsqueeze(2)

    x4, dt4, B4, C4, z4 = (standard(t) for t in (x, dt, B, C, z))
    batch, seq_len, nheads, dim = x4.shape
    A3 = A if A.dim() == 3 else A.unsqueeze(0)
    inter = intermediate_ssm_states
    if inter is not None and not has_heads and inter.dim() == 4:
        inter = inter.unsqueeze(2)
    dstate = state4.shape[-1]
    problems = []
    if state4.shape[1:] != (nheads, dim, dstate) or A3.shape != (nheads, dim, dstate):
        problems.append(f"state {tuple(state.shape)} and A {tuple(A.shape)} must match x {tuple(x.shape)}")
    if dt4.shape != x4.shape or (z4 is not None and z4.shape != x4.shape):
        problems.append(f"dt {tuple(dt.shape)} and z must be shaped like x {tuple(x.shape)}")
    if B4.shape != C4.shape or B4.shape[:2] != (batch, seq_len) or B4.shape[3] != dstate or nheads % B4.shape[2]:
        problems.append(f"B {tuple(B.shape)} and C {tuple(C.shape)} must be (batch, [seqlen,] [groups,] {dstate}) "
                        f"with nheads ({nheads}) divisible by the groups")
    if problems:
        raise ValueError("selective_state_update: " + "; ".join(problems))
    D2, bias2 = _per_head(D, nheads, dim), _per_head(dt_bias, nheads, dim)
    args = (state4, x4, dt4, A3, B4, C4, D2, z4, bias2, dt_softplus, state_batch_indices, inter)
    if state.is_cuda and x.is_cuda and have_triton() and dstate <= _MAX_DSTATE:
        out = _update_triton(*args)
    else:
        out = _update_torch(*args)
    out = out if has_heads else out.squeeze(2)
    return out.squeeze(1) if no_seq else out
