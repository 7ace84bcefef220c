"""The forward Triton kernels of the chunked SSD scan (launched by :mod:`megatron_core.ssm.ssd_scan_triton`).

``ssd_state_kernel`` walks the chunks in order per ``(batch x head, block of head_dim, block of state_dim)``
in fp32 and writes the state entering each chunk in the states buffer's dtype (starting from zeros, or from a given
initial state; optionally writing the state after the last chunk: the inference prefill's mode);
``ssd_chunk_forward_kernel`` computes one chunk's output per
``(batch x chunk, head, block of head_dim)`` with its ``state_dim`` products in a loop over blocks of ``BK``
columns (few live tiles, pipelined loads). ``ssd_chunk_cb_kernel`` optionally writes each chunk's ``C B^T`` per
group (fp32 scratch ``[b * chunks, g, Q, Q]``) once, for the heads of the group to read instead of recomputing it.
Triton is loaded through :mod:`megatron_core.jit` only.
"""

from __future__ import annotations

import functools
from typing import Any

from megatron_core.jit import triton_modules

__all__ = ["forward_kernels"]


@functools.cache
def forward_kernels() -> tuple[Any, Any, Any]:
    """``(ssd_state_kernel, ssd_chunk_forward_kernel, ssd_chunk_cb_kernel)``, built on first call (Triton must be
    installed)."""
    triton, tl = triton_modules()

    @triton.jit
    def ssd_state_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, st_ptr, init_ptr, final_ptr, length, chunks, heads,
                         heads_per_group, head_dim, state_dim, sx_b, sx_l, sx_h, sdt_b, sdt_l, sB_b, sB_l, sB_g,
                         sst_b, sst_c, sst_h, sin_b, sin_h, sfin_b, sfin_h,
                         Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
                         HAS_INIT: tl.constexpr, HAS_FINAL: tl.constexpr):
        # The state entering each chunk: state_{c+1} = exp(last_c) state_c + sum_j exp(last_c - cum_j) dt_j x_j B_j^T,
        # from zeros or (HAS_INIT) the initial state [b, h, p, n]; HAS_FINAL: the state after the last chunk is
        # written to final_ptr (fp32 [b, h, p, n]). Both state tensors have unit strides over (p, n) rows of n.
        bh = tl.program_id(0)
        b, h = bh // heads, bh % heads
        g = h // heads_per_group
        cols = tl.program_id(1) * BP + tl.arange(0, BP)
        col_ok = cols < head_dim
        ns = tl.program_id(2) * BN + tl.arange(0, BN)
        n_ok = ns < state_dim
        qs = tl.arange(0, Q)
        A = tl.load(A_ptr + h)
        x_base = x_ptr + b.to(tl.int64) * sx_b + h * sx_h
        B_base = B_ptr + b.to(tl.int64) * sB_b + g * sB_g
        st_base = st_ptr + b.to(tl.int64) * sst_b + h * sst_h + cols[:, None] * state_dim + ns[None, :]
        tile = cols[:, None] * state_dim + ns[None, :]
        tile_ok = col_ok[:, None] & n_ok[None, :]
        if HAS_INIT:
            state = tl.load(init_ptr + b.to(tl.int64) * sin_b + h * sin_h + tile, mask=tile_ok, other=0.0).to(tl.float32)
        else:
            state = tl.zeros([BP, BN], dtype=tl.float32)
        for c in range(chunks):
            tl.store(st_base + c * sst_c, state.to(st_ptr.dtype.element_ty), mask=tile_ok)
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
            state = state * tl.exp(last) + tl.dot(tl.trans(xw), Bm.to(x.dtype), input_precision=PREC)
        if HAS_FINAL:
            tl.store(final_ptr + b.to(tl.int64) * sfin_b + h * sfin_h + tile, state, mask=tile_ok)

    @triton.jit
    def ssd_chunk_cb_kernel(B_ptr, C_ptr, cb_ptr, length, chunks, groups, state_dim, sB_b, sB_l, sB_g, sC_b, sC_l,
                            sC_g, Q: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
        # cb[b * chunks + c, g] = C B^T over chunk c (fp32, products in the inputs' dtype).
        bc = tl.program_id(0)
        g = tl.program_id(1)
        b, c = bc // chunks, bc % chunks
        qs = tl.arange(0, Q)
        rows = c * Q + qs
        row_ok = rows < length
        ks = tl.arange(0, BK)
        B_rows = B_ptr + b.to(tl.int64) * sB_b + g * sB_g + rows[:, None] * sB_l
        C_rows = C_ptr + b.to(tl.int64) * sC_b + g * sC_g + rows[:, None] * sC_l
        cb = tl.zeros([Q, Q], dtype=tl.float32)
        for k0 in range(0, state_dim, BK):
            ns = k0 + ks
            qn_ok = row_ok[:, None] & (ns < state_dim)[None, :]
            Cm = tl.load(C_rows + ns[None, :], mask=qn_ok, other=0.0)
            Bm = tl.load(B_rows + ns[None, :], mask=qn_ok, other=0.0).to(Cm.dtype)
            cb += tl.dot(Cm, tl.trans(Bm), input_precision=PREC)
        tl.store(cb_ptr + (bc.to(tl.int64) * groups + g) * Q * Q + qs[:, None] * Q + qs[None, :], cb)

    @triton.jit
    def ssd_chunk_forward_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, st_ptr, cb_ptr,
                                 length, chunks, heads, heads_per_group, head_dim, state_dim,
                                 sx_b, sx_l, sx_h, sdt_b, sdt_l, sB_b, sB_l, sB_g, sC_b, sC_l, sC_g,
                                 sy_b, sy_l, sy_h, sst_b, sst_c, sst_h,
                                 Q: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                                 CB: tl.constexpr):
        # One chunk's output from its inputs and the state entering it (C B^T read from cb_ptr where CB).
        bc = tl.program_id(0)
        h = tl.program_id(1)
        b, c = bc // chunks, bc % chunks
        g = h // heads_per_group
        cols = tl.program_id(2) * BP + tl.arange(0, BP)
        col_ok = cols < head_dim
        qs = tl.arange(0, Q)
        rows = c * Q + qs
        row_ok = rows < length
        ks = tl.arange(0, BK)
        B_rows = B_ptr + b.to(tl.int64) * sB_b + g * sB_g + rows[:, None] * sB_l
        C_rows = C_ptr + b.to(tl.int64) * sC_b + g * sC_g + rows[:, None] * sC_l
        st_rows = st_ptr + b.to(tl.int64) * sst_b + c * sst_c + h * sst_h + cols[:, None] * state_dim
        x = tl.load(x_ptr + b.to(tl.int64) * sx_b + h * sx_h + rows[:, None] * sx_l + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        # C B^T and C state^T, both summed over state_dim in blocks of BK.
        cb = tl.zeros([Q, Q], dtype=tl.float32)
        inter = tl.zeros([Q, BP], dtype=tl.float32)
        for k0 in range(0, state_dim, BK):
            ns = k0 + ks
            n_ok = ns < state_dim
            qn_ok = row_ok[:, None] & n_ok[None, :]
            Cm = tl.load(C_rows + ns[None, :], mask=qn_ok, other=0.0).to(x.dtype)
            state = tl.load(st_rows + ns[None, :], mask=col_ok[:, None] & n_ok[None, :], other=0.0)
            if not CB:
                Bm = tl.load(B_rows + ns[None, :], mask=qn_ok, other=0.0).to(x.dtype)
                cb += tl.dot(Cm, tl.trans(Bm), input_precision=PREC)
            inter += tl.dot(Cm, tl.trans(state.to(x.dtype)), input_precision=PREC)
        if CB:
            cb = tl.load(cb_ptr + (bc.to(tl.int64) * (heads // heads_per_group) + g) * Q * Q + qs[:, None] * Q
                         + qs[None, :])
        A = tl.load(A_ptr + h)
        dt = tl.load(dt_ptr + b.to(tl.int64) * sdt_b + rows * sdt_l + h, mask=row_ok, other=0.0).to(tl.float32)
        cum = tl.cumsum(dt * A, 0)
        # y_i = sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j + exp(cum_i) C_i . state + D x_i.
        causal = qs[:, None] >= qs[None, :]
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        scores = (cb * decay * dt[None, :]).to(x.dtype)
        acc = tl.dot(scores, x, input_precision=PREC)
        Dv = tl.load(D_ptr + h * head_dim + cols, mask=col_ok, other=0.0)
        acc += tl.exp(cum)[:, None] * inter + Dv[None, :] * x.to(tl.float32)
        tl.store(y_ptr + b.to(tl.int64) * sy_b + h * sy_h + rows[:, None] * sy_l + cols[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return ssd_state_kernel, ssd_chunk_forward_kernel, ssd_chunk_cb_kernel
