"""The chunked SSD scan (Mamba-2) as Triton kernels on CUDA, forward and backward.

Same function as :func:`megatron_core.ssm.ssd_scan.ssd_chunk_scan` (the CPU path and the reference). Forward: a
sequential walk over the chunks per ``(batch, head, block of head_dim)`` writes the state entering each chunk
(fp32 ``[b, chunks, h, p, n]``, kept for the backward), then a chunk-parallel kernel computes each chunk's
output: the decay-masked ``C B^T`` product times ``dt x`` plus ``C`` times the entering state. Backward: a reverse
walk writes the gradient of the state leaving each chunk, then a chunk-parallel kernel computes every input's
gradient for its chunk; the heads of a group add their ``dB``/``dC`` with fp32 atomics.

The kernels' chunk length is their own (:data:`KERNEL_CHUNK`, 64 rows: every tile of one chunk fits in one
program); the result is the same function as any other chunk length, rounded differently. Products take the
inputs' dtype (bf16 operands, fp32 accumulation); the decays, ``dt`` and the states stay fp32, as
Megatron-Core keeps them. fp32 inputs use full-precision (not tf32) products. Triton is loaded through
:mod:`megatron_core.jit` only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, next_power_of_two, triton_modules, triton_op

__all__ = ["KERNEL_CHUNK", "ssd_chunk_scan_triton", "ssd_scan_triton_supported"]

KERNEL_CHUNK = 64
_MAX_DIM = 256  # head_dim and state_dim up to this (one tile each)
_STATE_BLOCK_P = 32  # head_dim columns per program of the sequential walks over the chunks (both directions)
_STATE_GRAD_BLOCK_P = 32
_STATE_WARPS = 4
_FWD_BLOCK_P = 64  # head_dim columns per program of the chunk-parallel forward
_BWD_BLOCK_P = 64  # ... and backward (fewer atomics on dB/dC)
_FWD_WARPS, _BWD_WARPS = 4, 8


def ssd_scan_triton_supported(x: torch.Tensor, initial_state: torch.Tensor | None = None,
                              return_final_state: bool = False) -> bool:
    """Whether :func:`ssd_chunk_scan_triton` serves these inputs.

    CUDA, bf16/fp16/fp32, ``head_dim`` and ``state_dim`` <= 256 (checked by the caller's shapes), no initial
    state and no final state (the training path), Triton and ``torch.library.triton_op`` available.
    """
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and initial_state is None
            and not return_final_state and x.shape[-1] <= _MAX_DIM and _FORWARD_OP is not None and have_triton())


@functools.cache
def _kernels() -> tuple[Any, Any, Any, Any]:
    triton, tl = triton_modules()

    @triton.jit
    def ssd_state_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, st_ptr, length, chunks, heads, heads_per_group, head_dim,
                         state_dim, sx_b, sx_l, sx_h, sdt_b, sdt_l, sB_b, sB_l, sB_g, sst_b, sst_c, sst_h,
                         Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
        # Forward walk: the state entering each chunk, state_{c+1} = exp(last_c) state_c
        # + sum_j exp(last_c - cum_j) dt_j x_j B_j^T over chunk c.
        bh = tl.program_id(0)
        b, h = bh // heads, bh % heads
        g = h // heads_per_group
        cols = tl.program_id(1) * BP + tl.arange(0, BP)
        col_ok = cols < head_dim
        ns = tl.arange(0, BN)
        n_ok = ns < state_dim
        qs = tl.arange(0, Q)
        A = tl.load(A_ptr + h)
        x_base = x_ptr + b.to(tl.int64) * sx_b + h * sx_h
        B_base = B_ptr + b.to(tl.int64) * sB_b + g * sB_g
        st_base = st_ptr + b.to(tl.int64) * sst_b + h * sst_h + cols[:, None] * state_dim + ns[None, :]
        state = tl.zeros([BP, BN], dtype=tl.float32)
        for c in range(chunks):
            tl.store(st_base + c * sst_c, state, mask=col_ok[:, None] & n_ok[None, :])
            rows = c * Q + qs
            row_ok = rows < length
            dt = tl.load(dt_ptr + b.to(tl.int64) * sdt_b + rows * sdt_l + h, mask=row_ok, other=0.0).to(tl.float32)
            x = tl.load(x_base + rows[:, None] * sx_l + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0)
            Bm = tl.load(B_base + rows[:, None] * sB_l + ns[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0)
            a = dt * A
            cum = tl.cumsum(a, 0)
            last = tl.sum(a, 0)
            xw = (x.to(tl.float32) * (tl.exp(last - cum) * dt)[:, None]).to(x.dtype)
            state = state * tl.exp(last) + tl.dot(tl.trans(xw), Bm, input_precision=PREC)

    @triton.jit
    def ssd_chunk_forward_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, st_ptr,
                                 length, chunks, heads, heads_per_group, head_dim, state_dim,
                                 sx_b, sx_l, sx_h, sdt_b, sdt_l, sB_b, sB_l, sB_g, sC_b, sC_l, sC_g,
                                 sy_b, sy_l, sy_h, sst_b, sst_c, sst_h,
                                 Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
        # One chunk's output from its inputs and the state entering it.
        bc = tl.program_id(0)
        h = tl.program_id(1)
        b, c = bc // chunks, bc % chunks
        g = h // heads_per_group
        cols = tl.program_id(2) * BP + tl.arange(0, BP)
        col_ok = cols < head_dim
        ns = tl.arange(0, BN)
        n_ok = ns < state_dim
        qs = tl.arange(0, Q)
        causal = qs[:, None] >= qs[None, :]
        rows = c * Q + qs
        row_ok = rows < length
        A = tl.load(A_ptr + h)
        Dv = tl.load(D_ptr + h * head_dim + cols, mask=col_ok, other=0.0)
        dt = tl.load(dt_ptr + b.to(tl.int64) * sdt_b + rows * sdt_l + h, mask=row_ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + b.to(tl.int64) * sx_b + h * sx_h + rows[:, None] * sx_l + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        Bm = tl.load(B_ptr + b.to(tl.int64) * sB_b + g * sB_g + rows[:, None] * sB_l + ns[None, :],
                     mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        Cm = tl.load(C_ptr + b.to(tl.int64) * sC_b + g * sC_g + rows[:, None] * sC_l + ns[None, :],
                     mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        state = tl.load(st_ptr + b.to(tl.int64) * sst_b + c * sst_c + h * sst_h + cols[:, None] * state_dim
                        + ns[None, :], mask=col_ok[:, None] & n_ok[None, :], other=0.0)
        cum = tl.cumsum(dt * A, 0)
        # Intra-chunk: y_i = sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j.
        cb = tl.dot(Cm, tl.trans(Bm), input_precision=PREC)
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        scores = (cb * decay * dt[None, :]).to(x.dtype)
        acc = tl.dot(scores, x, input_precision=PREC)
        # Inter-chunk: y_i += exp(cum_i) C_i . state.
        inter = tl.dot(Cm, tl.trans(state.to(x.dtype)), input_precision=PREC)
        acc += tl.exp(cum)[:, None] * inter + Dv[None, :] * x.to(tl.float32)
        tl.store(y_ptr + b.to(tl.int64) * sy_b + h * sy_h + rows[:, None] * sy_l + cols[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def ssd_state_grad_kernel(dt_ptr, A_ptr, C_ptr, dy_ptr, gs_ptr, length, chunks, heads, heads_per_group,
                              head_dim, state_dim, sdt_b, sdt_l, sC_b, sC_l, sC_g, sdy_b, sdy_l, sdy_h,
                              sgs_b, sgs_c, sgs_h, Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                              PREC: tl.constexpr):
        # Reverse walk: the gradient of the state leaving each chunk, d state_c = exp(last_{c+1}) d state_{c+1}
        # + sum_i exp(cum_i) dy_i^T C_i over chunk c + 1.
        bh = tl.program_id(0)
        b, h = bh // heads, bh % heads
        g = h // heads_per_group
        cols = tl.program_id(1) * BP + tl.arange(0, BP)
        col_ok = cols < head_dim
        ns = tl.arange(0, BN)
        n_ok = ns < state_dim
        qs = tl.arange(0, Q)
        A = tl.load(A_ptr + h)
        dy_base = dy_ptr + b.to(tl.int64) * sdy_b + h * sdy_h
        C_base = C_ptr + b.to(tl.int64) * sC_b + g * sC_g
        gs_base = gs_ptr + b.to(tl.int64) * sgs_b + h * sgs_h + cols[:, None] * state_dim + ns[None, :]
        grad_state = tl.zeros([BP, BN], dtype=tl.float32)
        for step in range(chunks):
            c = chunks - 1 - step
            tl.store(gs_base + c * sgs_c, grad_state, mask=col_ok[:, None] & n_ok[None, :])
            rows = c * Q + qs
            row_ok = rows < length
            dt = tl.load(dt_ptr + b.to(tl.int64) * sdt_b + rows * sdt_l + h, mask=row_ok, other=0.0).to(tl.float32)
            dy = tl.load(dy_base + rows[:, None] * sdy_l + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                         other=0.0)
            Cm = tl.load(C_base + rows[:, None] * sC_l + ns[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0)
            a = dt * A
            cum = tl.cumsum(a, 0)
            dy_in = (dy.to(tl.float32) * tl.exp(cum)[:, None]).to(dy.dtype)
            grad_state = tl.dot(tl.trans(dy_in), Cm, input_precision=PREC) + tl.exp(tl.sum(a, 0)) * grad_state

    @triton.jit
    def ssd_chunk_backward_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dy_ptr, st_ptr, gs_ptr,
                                  dx_ptr, ddt_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr,
                                  length, chunks, heads, heads_per_group, head_dim, state_dim, p_blocks,
                                  sx_b, sx_l, sx_h, sdt_b, sdt_l, sB_b, sB_l, sB_g, sC_b, sC_l, sC_g,
                                  sdy_b, sdy_l, sdy_h, sst_b, sst_c, sst_h,
                                  Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
                                  ATOMIC_DT: tl.constexpr):
        # One chunk, all independent of the others once the entering state and the leaving state's gradient
        # are known (both fp32 [b, chunks, h, p, n], same strides).
        bc = tl.program_id(0)
        h = tl.program_id(1)
        pb = tl.program_id(2)
        b, c = bc // chunks, bc % chunks
        groups = heads // heads_per_group
        g = h // heads_per_group
        cols = pb * BP + tl.arange(0, BP)
        col_ok = cols < head_dim
        ns = tl.arange(0, BN)
        n_ok = ns < state_dim
        qs = tl.arange(0, Q)
        causal = qs[:, None] >= qs[None, :]
        rows = c * Q + qs
        row_ok = rows < length
        qp_ok = row_ok[:, None] & col_ok[None, :]
        qn_ok = row_ok[:, None] & n_ok[None, :]
        pn_ok = col_ok[:, None] & n_ok[None, :]
        A = tl.load(A_ptr + h)
        Dv = tl.load(D_ptr + h * head_dim + cols, mask=col_ok, other=0.0)
        x = tl.load(x_ptr + b.to(tl.int64) * sx_b + h * sx_h + rows[:, None] * sx_l + cols[None, :], mask=qp_ok,
                    other=0.0)
        dy_offs = b.to(tl.int64) * sdy_b + h * sdy_h + rows[:, None] * sdy_l + cols[None, :]
        dy = tl.load(dy_ptr + dy_offs, mask=qp_ok, other=0.0)
        Bm = tl.load(B_ptr + b.to(tl.int64) * sB_b + g * sB_g + rows[:, None] * sB_l + ns[None, :], mask=qn_ok,
                     other=0.0)
        Cm = tl.load(C_ptr + b.to(tl.int64) * sC_b + g * sC_g + rows[:, None] * sC_l + ns[None, :], mask=qn_ok,
                     other=0.0)
        st_offs = b.to(tl.int64) * sst_b + c * sst_c + h * sst_h + cols[:, None] * state_dim + ns[None, :]
        prev = tl.load(st_ptr + st_offs, mask=pn_ok, other=0.0)
        grad_state = tl.load(gs_ptr + st_offs, mask=pn_ok, other=0.0)
        dt = tl.load(dt_ptr + b.to(tl.int64) * sdt_b + rows * sdt_l + h, mask=row_ok, other=0.0).to(tl.float32)
        a = dt * A
        cum = tl.cumsum(a, 0)
        last = tl.sum(a, 0)
        xf = x.to(tl.float32)
        dyf = dy.to(tl.float32)
        xdt = xf * dt[:, None]
        # Intra-chunk part: y_i = sum_j s_ij xdt_j, s_ij = (C_i . B_j) exp(cum_i - cum_j), j <= i.
        cb = tl.dot(Cm, tl.trans(Bm), input_precision=PREC)
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        s = cb * decay
        d_xdt = tl.dot(tl.trans(s.to(x.dtype)), dy, input_precision=PREC)
        ds = tl.dot(dy, tl.trans(xdt.to(x.dtype)), input_precision=PREC)
        dcb = tl.where(causal, ds * decay, 0.0).to(x.dtype)
        dC = tl.dot(dcb, Bm, input_precision=PREC)
        dB = tl.dot(tl.trans(dcb), Cm, input_precision=PREC)
        m = tl.where(causal, ds * s, 0.0)
        dcum = tl.sum(m, 1) - tl.sum(m, 0)
        # Inter-chunk part: y_i += exp(cum_i) C_i . prev.
        e_in = tl.exp(cum)
        cp = tl.dot(Cm, tl.trans(prev.to(x.dtype)), input_precision=PREC)
        dy_in = (dyf * e_in[:, None]).to(x.dtype)
        dC += tl.dot(dy_in, prev.to(x.dtype), input_precision=PREC)
        dcum += e_in * tl.sum(dyf * cp, 1)
        # State leaving the chunk: exp(last) prev + sum_j exp(last - cum_j) xdt_j B_j^T.
        to_end = tl.exp(last - cum)
        gb = tl.dot(Bm, tl.trans(grad_state.to(x.dtype)), input_precision=PREC)
        d_xdt += to_end[:, None] * gb
        dB += tl.dot((xdt * to_end[:, None]).to(x.dtype), grad_state.to(x.dtype), input_precision=PREC)
        d_to_end = tl.sum(xdt * gb, 1) * to_end
        dcum -= d_to_end
        d_last = tl.sum(d_to_end, 0) + tl.exp(last) * tl.sum(tl.sum(grad_state * prev, 1), 0)
        # cum_i = sum_{k <= i} a_k, last = cum_{Q-1}: da_k = sum_{i >= k} dcum_i + d_last.
        da = tl.sum(dcum, 0) - tl.cumsum(dcum, 0) + dcum + d_last
        ddt = tl.sum(d_xdt * xf, 1) + da * A
        dx = d_xdt * dt[:, None] + Dv[None, :] * dyf
        tl.store(dx_ptr + dy_offs, dx.to(dx_ptr.dtype.element_ty), mask=qp_ok)
        ddt_ptrs = ddt_ptr + (b.to(tl.int64) * length + rows) * heads + h
        if ATOMIC_DT:
            tl.atomic_add(ddt_ptrs, ddt, mask=row_ok, sem="relaxed")
        else:
            tl.store(ddt_ptrs, ddt, mask=row_ok)
        bc_ptrs = (b.to(tl.int64) * length + rows[:, None]) * groups * state_dim + g * state_dim + ns[None, :]
        tl.atomic_add(dB_ptr + bc_ptrs, dB, mask=qn_ok, sem="relaxed")
        tl.atomic_add(dC_ptr + bc_ptrs, dC, mask=qn_ok, sem="relaxed")
        slot = (bc * heads + h) * p_blocks + pb
        tl.store(dA_ptr + slot, tl.sum(da * dt, 0))
        tl.store(dD_ptr + (bc * heads + h).to(tl.int64) * head_dim + cols, tl.sum(dyf * xf, 0), mask=col_ok)

    return ssd_state_kernel, ssd_chunk_forward_kernel, ssd_state_grad_kernel, ssd_chunk_backward_kernel


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _forward(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, length, heads, head_dim = x.shape
    groups, state_dim = B.shape[2], B.shape[3]
    chunks = -(-length // KERNEL_CHUNK)
    y = torch.empty(batch, length, heads, head_dim, device=x.device, dtype=x.dtype)
    states = torch.empty(batch, chunks, heads, head_dim, state_dim, device=x.device, dtype=torch.float32)
    block_n = max(16, next_power_of_two(state_dim))
    prec = _precision(x.dtype)
    state_kernel, chunk_kernel, _, _ = (torch.library.wrap_triton(k) for k in _kernels())
    block_p = min(_STATE_BLOCK_P, max(16, next_power_of_two(head_dim)))
    # fp32 tiles with the default three pipeline stages overflow shared memory; one stage fits.
    state_kernel[(batch * heads, -(-head_dim // block_p))](
        x, dt, A, B, states, length, chunks, heads, heads // groups, head_dim, state_dim,
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), B.stride(2),
        states.stride(0), states.stride(1), states.stride(2),
        Q=KERNEL_CHUNK, BP=block_p, BN=block_n, PREC=prec, num_warps=_STATE_WARPS,
        num_stages=1 if x.dtype == torch.float32 else 3)
    block_p = min(_FWD_BLOCK_P, max(16, next_power_of_two(head_dim)))
    chunk_kernel[(batch * chunks, heads, -(-head_dim // block_p))](
        x, dt, A, B, C, D, y, states, length, chunks, heads, heads // groups, head_dim, state_dim,
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2), y.stride(0), y.stride(1), y.stride(2),
        states.stride(0), states.stride(1), states.stride(2),
        Q=KERNEL_CHUNK, BP=block_p, BN=block_n, PREC=prec, num_warps=_FWD_WARPS)
    return y, states


def _backward(dy: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: torch.Tensor, states: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, length, heads, head_dim = x.shape
    groups, state_dim = B.shape[2], B.shape[3]
    chunks = states.shape[1]
    block_n = max(16, next_power_of_two(state_dim))
    prec = _precision(x.dtype)
    _, _, state_grad_kernel, chunk_kernel = (torch.library.wrap_triton(k) for k in _kernels())
    # The gradient of the state leaving each chunk, in a buffer shaped (and strided) like ``states``.
    grad_states = torch.empty_like(states)
    block_p = min(_STATE_GRAD_BLOCK_P, max(16, next_power_of_two(head_dim)))
    state_grad_kernel[(batch * heads, -(-head_dim // block_p))](
        dt, A, C, dy, grad_states, length, chunks, heads, heads // groups, head_dim, state_dim,
        dt.stride(0), dt.stride(1), C.stride(0), C.stride(1), C.stride(2), dy.stride(0), dy.stride(1), dy.stride(2),
        grad_states.stride(0), grad_states.stride(1), grad_states.stride(2),
        Q=KERNEL_CHUNK, BP=block_p, BN=block_n, PREC=prec, num_warps=_STATE_WARPS,
        num_stages=1 if x.dtype == torch.float32 else 3)
    block_p = min(_BWD_BLOCK_P, max(16, next_power_of_two(head_dim)))
    p_blocks = -(-head_dim // block_p)
    dx = torch.empty_like(dy)
    ddt = (torch.zeros if p_blocks > 1 else torch.empty)(batch, length, heads, device=x.device, dtype=torch.float32)
    dB = torch.zeros(batch, length, groups, state_dim, device=x.device, dtype=torch.float32)
    dC = torch.zeros_like(dB)
    dA = torch.empty(batch * chunks, heads, p_blocks, device=x.device, dtype=torch.float32)
    dD = torch.empty(batch * chunks, heads, head_dim, device=x.device, dtype=torch.float32)
    chunk_kernel[(batch * chunks, heads, p_blocks)](
        x, dt, A, B, C, D, dy, states, grad_states, dx, ddt, dB, dC, dA, dD,
        length, chunks, heads, heads // groups, head_dim, state_dim, p_blocks,
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2), dy.stride(0), dy.stride(1), dy.stride(2),
        states.stride(0), states.stride(1), states.stride(2),
        Q=KERNEL_CHUNK, BP=block_p, BN=block_n, PREC=prec, ATOMIC_DT=p_blocks > 1, num_warps=_BWD_WARPS)
    return dx, ddt, dA.sum((0, 2)), dB, dC, dD.sum(0)


# Registered at import where Triton is installed (the kernels are built on their first launch).
_FORWARD_OP = triton_op("megatron_core::ssd_scan_forward", _forward)
_BACKWARD_OP = triton_op("megatron_core::ssd_scan_backward", _backward)


class _SSDScan(torch.autograd.Function):
    """``y`` of the scan; the backward reads the states the forward kept (fp32, one per chunk)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor) -> torch.Tensor:
        y, states = _FORWARD_OP(x, dt, A, B, C, D)
        ctx.save_for_backward(x, dt, A, B, C, D, states)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple:
        x, dt, A, B, C, D, states = ctx.saved_tensors
        dx, ddt, dA, dB, dC, dD = _BACKWARD_OP(dy.contiguous(), x, dt, A, B, C, D, states)
        return dx, ddt, dA, dB.to(B.dtype), dC.to(C.dtype), dD


def ssd_chunk_scan_triton(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~megatron_core.ssm.ssd_scan.ssd_chunk_scan` (no initial or final state) through the Triton kernels.

    ``x`` ``[b, l, h, p]``, ``dt`` ``[b, l, h]`` (any float dtype; fp32 inside), ``A`` ``[h]``, ``B``/``C``
    ``[b, l, g, n]`` (any strides with a unit last stride: slices of one projection are read in place),
    ``D`` ``[h]`` or ``[h, p]``. Returns ``y`` in ``x``'s dtype; gradients flow to every input.
    """
    heads, head_dim = x.shape[2], x.shape[3]
    groups, state_dim = B.shape[2], B.shape[3]
    if heads % groups != 0 or C.shape != B.shape or state_dim > _MAX_DIM or head_dim > _MAX_DIM:
        raise ValueError(f"ssd_chunk_scan_triton: heads ({heads}) must be divisible by groups ({groups}), C "
                         f"{tuple(C.shape)} must match B {tuple(B.shape)}, head_dim ({head_dim}) and state_dim "
                         f"({state_dim}) at most {_MAX_DIM}")
    if D is None:
        D = torch.zeros(heads, head_dim, device=x.device, dtype=torch.float32)
    D_full = (D.float() if D.dim() == 2 else D.float()[:, None].expand(heads, head_dim)).contiguous()

    def unit_last(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(-1) == 1 else t.contiguous()

    dt32 = dt.float()
    dt32 = dt32 if dt32.stride(-1) == 1 and dt32.stride(1) == heads else dt32.contiguous()
    y = _SSDScan.apply(unit_last(x), dt32, A.float().contiguous(), unit_last(B), unit_last(C), D_full)
    return y
