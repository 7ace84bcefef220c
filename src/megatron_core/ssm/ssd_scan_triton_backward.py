"""The backward Triton kernels of the chunked SSD scan (launched by :mod:`megatron_core.ssm.ssd_scan_triton`).

Three kernels, each with few live tiles:

* ``ssd_state_grad_kernel`` walks the chunks in reverse per ``(batch x head, block of head_dim, block of
  state_dim)`` and writes the gradient of the state leaving each chunk (shaped and typed like the kept states);
* ``ssd_chunk_dx_kernel``, per ``(batch x chunk, head, block of head_dim)``: ``dx`` and everything that flows
  into ``dt``, ``A`` and ``D`` (per-program partial sums, reduced by the caller);
* ``ssd_chunk_dbc_kernel``, per ``(batch x chunk, group, block of state_dim)``: ``dB`` and ``dC``, summed over
  the group's heads inside the program (no atomics). The heads' decay-weighted ``dy x^T`` products are added
  first and multiplied by the group's ``B``/``C`` once;
* or, instead of those two, ``ssd_chunk_bwd_group_kernel``: both in one program per ``(batch x chunk, group)``
  over the whole ``state_dim`` (each state and state gradient read once, ``C B^T`` once per group; more live
  tiles per program).

Triton is loaded through :mod:`megatron_core.jit` only.
"""

from __future__ import annotations

import functools
from typing import Any

from megatron_core.jit import triton_modules

__all__ = ["backward_kernels"]


@functools.cache
def backward_kernels() -> tuple[Any, Any, Any, Any]:
    """``(ssd_state_grad_kernel, ssd_chunk_dx_kernel, ssd_chunk_dbc_kernel, ssd_chunk_bwd_group_kernel)``, built
    on first call."""
    triton, tl = triton_modules()

    @triton.jit
    def ssd_state_grad_kernel(dt_ptr, A_ptr, C_ptr, dy_ptr, gs_ptr, length, chunks, heads, heads_per_group,
                              head_dim, state_dim, sdt_b, sdt_l, sC_b, sC_l, sC_g, sdy_b, sdy_l, sdy_h,
                              sgs_b, sgs_c, sgs_h, Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                              PREC: tl.constexpr):
        # d state_c = exp(last_{c+1}) d state_{c+1} + sum_i exp(cum_i) dy_i^T C_i over chunk c + 1.
        bh = tl.program_id(0)
        b, h = bh // heads, bh % heads
        g = h // heads_per_group
        cols = tl.program_id(1) * BP + tl.arange(0, BP)
        col_ok = cols < head_dim
        ns = tl.program_id(2) * BN + tl.arange(0, BN)
        n_ok = ns < state_dim
        qs = tl.arange(0, Q)
        A = tl.load(A_ptr + h)
        dy_base = dy_ptr + b.to(tl.int64) * sdy_b + h * sdy_h
        C_base = C_ptr + b.to(tl.int64) * sC_b + g * sC_g
        gs_base = gs_ptr + b.to(tl.int64) * sgs_b + h * sgs_h + cols[:, None] * state_dim + ns[None, :]
        grad_state = tl.zeros([BP, BN], dtype=tl.float32)
        for step in range(chunks):
            c = chunks - 1 - step
            tl.store(gs_base + c * sgs_c, grad_state.to(gs_ptr.dtype.element_ty),
                     mask=col_ok[:, None] & n_ok[None, :])
            rows = c * Q + qs
            row_ok = rows < length
            dt = tl.load(dt_ptr + b.to(tl.int64) * sdt_b + rows * sdt_l + h, mask=row_ok, other=0.0).to(tl.float32)
            dy = tl.load(dy_base + rows[:, None] * sdy_l + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                         other=0.0)
            Cm = tl.load(C_base + rows[:, None] * sC_l + ns[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0)
            a = dt * A
            dy_in = (dy.to(tl.float32) * tl.exp(tl.cumsum(a, 0))[:, None]).to(dy.dtype)
            grad_state = (tl.dot(tl.trans(dy_in), Cm.to(dy.dtype), input_precision=PREC)
                          + tl.exp(tl.sum(a, 0)) * grad_state)

    @triton.jit
    def ssd_chunk_dx_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dy_ptr, st_ptr, gs_ptr, cb_ptr,
                            dx_ptr, ddt_ptr, dA_ptr, dD_ptr,
                            length, chunks, heads, heads_per_group, head_dim, state_dim, p_blocks,
                            sx_b, sx_l, sx_h, sdt_b, sdt_l, sB_b, sB_l, sB_g, sC_b, sC_l, sC_g,
                            sdy_b, sdy_l, sdy_h, sst_b, sst_c, sst_h,
                            Q: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                            ATOMIC_DT: tl.constexpr, CB: tl.constexpr):
        # y_i = sum_{j <= i} s_ij xdt_j + exp(cum_i) C_i . prev + D x_i with s_ij = (C_i . B_j) exp(cum_i - cum_j),
        # and the state leaving the chunk exp(last) prev + sum_j exp(last - cum_j) xdt_j B_j^T. C B^T is read from
        # cb_ptr where CB (the forward's per-group scratch).
        bc = tl.program_id(0)
        h = tl.program_id(1)
        pb = tl.program_id(2)
        b, c = bc // chunks, bc % chunks
        g = h // heads_per_group
        cols = pb * BP + tl.arange(0, BP)
        col_ok = cols < head_dim
        qs = tl.arange(0, Q)
        rows = c * Q + qs
        row_ok = rows < length
        qp_ok = row_ok[:, None] & col_ok[None, :]
        ks = tl.arange(0, BK)
        B_rows = B_ptr + b.to(tl.int64) * sB_b + g * sB_g + rows[:, None] * sB_l
        C_rows = C_ptr + b.to(tl.int64) * sC_b + g * sC_g + rows[:, None] * sC_l
        st_offs = b.to(tl.int64) * sst_b + c * sst_c + h * sst_h + cols[:, None] * state_dim
        dy_offs = b.to(tl.int64) * sdy_b + h * sdy_h + rows[:, None] * sdy_l + cols[None, :]
        dy = tl.load(dy_ptr + dy_offs, mask=qp_ok, other=0.0)
        # Everything summed over state_dim, in blocks of BK: C B^T, C prev^T, B gs^T and <gs, prev>.
        cb = tl.zeros([Q, Q], dtype=tl.float32)
        cp = tl.zeros([Q, BP], dtype=tl.float32)
        gb = tl.zeros([Q, BP], dtype=tl.float32)
        gs_prev = tl.zeros([BP], dtype=tl.float32)
        for k0 in range(0, state_dim, BK):
            ns = k0 + ks
            n_ok = ns < state_dim
            qn_ok = row_ok[:, None] & n_ok[None, :]
            pn_ok = col_ok[:, None] & n_ok[None, :]
            Cm = tl.load(C_rows + ns[None, :], mask=qn_ok, other=0.0).to(dy.dtype)
            Bm = tl.load(B_rows + ns[None, :], mask=qn_ok, other=0.0).to(dy.dtype)
            prev = tl.load(st_ptr + st_offs + ns[None, :], mask=pn_ok, other=0.0)
            grad_state = tl.load(gs_ptr + st_offs + ns[None, :], mask=pn_ok, other=0.0)
            if not CB:
                cb += tl.dot(Cm, tl.trans(Bm), input_precision=PREC)
            cp += tl.dot(Cm, tl.trans(prev.to(dy.dtype)), input_precision=PREC)
            gb += tl.dot(Bm, tl.trans(grad_state.to(dy.dtype)), input_precision=PREC)
            gs_prev += tl.sum(grad_state.to(tl.float32) * prev.to(tl.float32), 1)
        if CB:
            cb = tl.load(cb_ptr + (bc.to(tl.int64) * (heads // heads_per_group) + g) * Q * Q + qs[:, None] * Q
                         + qs[None, :])
        A = tl.load(A_ptr + h)
        dt = tl.load(dt_ptr + b.to(tl.int64) * sdt_b + rows * sdt_l + h, mask=row_ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + b.to(tl.int64) * sx_b + h * sx_h + rows[:, None] * sx_l + cols[None, :], mask=qp_ok,
                    other=0.0)
        a = dt * A
        cum = tl.cumsum(a, 0)
        last = tl.sum(a, 0)
        xf = x.to(tl.float32)
        dyf = dy.to(tl.float32)
        xdt = xf * dt[:, None]
        causal = qs[:, None] >= qs[None, :]
        s = cb * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        d_xdt = tl.dot(tl.trans(s.to(dy.dtype)), dy, input_precision=PREC)
        ds = tl.dot(dy, tl.trans(xdt.to(dy.dtype)), input_precision=PREC)
        m = tl.where(causal, ds * s, 0.0)
        dcum = tl.sum(m, 1) - tl.sum(m, 0)
        dcum += tl.exp(cum) * tl.sum(dyf * cp, 1)
        to_end = tl.exp(last - cum)
        d_xdt += to_end[:, None] * gb
        d_to_end = tl.sum(xdt * gb, 1) * to_end
        dcum -= d_to_end
        d_last = tl.sum(d_to_end, 0) + tl.exp(last) * tl.sum(gs_prev, 0)
        # cum_i = sum_{k <= i} a_k, last = cum_{Q-1}: da_k = sum_{i >= k} dcum_i + d_last.
        da = tl.sum(dcum, 0) - tl.cumsum(dcum, 0) + dcum + d_last
        ddt = tl.sum(d_xdt * xf, 1) + da * A
        Dv = tl.load(D_ptr + h * head_dim + cols, mask=col_ok, other=0.0)
        dx = d_xdt * dt[:, None] + Dv[None, :] * dyf
        tl.store(dx_ptr + dy_offs, dx.to(dx_ptr.dtype.element_ty), mask=qp_ok)
        ddt_ptrs = ddt_ptr + (b.to(tl.int64) * length + rows) * heads + h
        if ATOMIC_DT:
            tl.atomic_add(ddt_ptrs, ddt, mask=row_ok, sem="relaxed")
        else:
            tl.store(ddt_ptrs, ddt, mask=row_ok)
        tl.store(dA_ptr + (bc * heads + h) * p_blocks + pb, tl.sum(da * dt, 0))
        tl.store(dD_ptr + (bc * heads + h).to(tl.int64) * head_dim + cols, tl.sum(dyf * xf, 0), mask=col_ok)

    @triton.jit
    def ssd_chunk_dbc_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, dy_ptr, st_ptr, gs_ptr, dB_ptr, dC_ptr,
                             length, chunks, heads_per_group, head_dim, state_dim, groups,
                             sx_b, sx_l, sx_h, sdt_b, sdt_l, sB_b, sB_l, sB_g, sC_b, sC_l, sC_g,
                             sdy_b, sdy_l, sdy_h, sst_b, sst_c, sst_h,
                             Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
        # dC_i = sum_h [sum_j w_ij B_j + exp(cum_i) dy_i prev], dB_j = sum_h [sum_i w_ij C_i + exp(last - cum_j)
        # xdt_j gs] with w_ij = (dy_i . xdt_j) exp(cum_i - cum_j) for j <= i, per head h of the group.
        bc = tl.program_id(0)
        g = tl.program_id(1)
        b, c = bc // chunks, bc % chunks
        ns = tl.program_id(2) * BN + tl.arange(0, BN)
        n_ok = ns < state_dim
        qs = tl.arange(0, Q)
        rows = c * Q + qs
        row_ok = rows < length
        causal = qs[:, None] >= qs[None, :]
        ps = tl.arange(0, BP)
        dB = tl.zeros([Q, BN], dtype=tl.float32)
        dC = tl.zeros([Q, BN], dtype=tl.float32)
        w = tl.zeros([Q, Q], dtype=tl.float32)
        for hh in range(heads_per_group):
            h = g * heads_per_group + hh
            A = tl.load(A_ptr + h)
            dt = tl.load(dt_ptr + b.to(tl.int64) * sdt_b + rows * sdt_l + h, mask=row_ok, other=0.0).to(tl.float32)
            a = dt * A
            cum = tl.cumsum(a, 0)
            last = tl.sum(a, 0)
            e_in = tl.exp(cum)
            to_end = tl.exp(last - cum) * dt
            x_rows = x_ptr + b.to(tl.int64) * sx_b + h * sx_h + rows[:, None] * sx_l
            dy_rows = dy_ptr + b.to(tl.int64) * sdy_b + h * sdy_h + rows[:, None] * sdy_l
            st_offs = b.to(tl.int64) * sst_b + c * sst_c + h * sst_h + ns[None, :]
            ds = tl.zeros([Q, Q], dtype=tl.float32)
            for p0 in range(0, head_dim, BP):
                cols = p0 + ps
                col_ok = cols < head_dim
                qp_ok = row_ok[:, None] & col_ok[None, :]
                pn_ok = col_ok[:, None] & n_ok[None, :]
                x = tl.load(x_rows + cols[None, :], mask=qp_ok, other=0.0)
                dy = tl.load(dy_rows + cols[None, :], mask=qp_ok, other=0.0)
                prev = tl.load(st_ptr + st_offs + cols[:, None] * state_dim, mask=pn_ok, other=0.0)
                grad_state = tl.load(gs_ptr + st_offs + cols[:, None] * state_dim, mask=pn_ok, other=0.0)
                xf = x.to(tl.float32)
                ds += tl.dot(dy, tl.trans((xf * dt[:, None]).to(x.dtype)), input_precision=PREC)
                dy_in = (dy.to(tl.float32) * e_in[:, None]).to(x.dtype)
                dC += tl.dot(dy_in, prev.to(x.dtype), input_precision=PREC)
                dB += tl.dot((xf * to_end[:, None]).to(x.dtype), grad_state.to(x.dtype), input_precision=PREC)
            w += tl.where(causal, ds * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf"))), 0.0)
        qn_ok = row_ok[:, None] & n_ok[None, :]
        Bm = tl.load(B_ptr + b.to(tl.int64) * sB_b + g * sB_g + rows[:, None] * sB_l + ns[None, :], mask=qn_ok,
                     other=0.0)
        Cm = tl.load(C_ptr + b.to(tl.int64) * sC_b + g * sC_g + rows[:, None] * sC_l + ns[None, :], mask=qn_ok,
                     other=0.0)
        w16 = w.to(Bm.dtype)
        dC += tl.dot(w16, Bm, input_precision=PREC)
        dB += tl.dot(tl.trans(w16), Cm.to(Bm.dtype), input_precision=PREC)
        out = (b.to(tl.int64) * length + rows[:, None]) * groups * state_dim + g * state_dim + ns[None, :]
        tl.store(dB_ptr + out, dB.to(dB_ptr.dtype.element_ty), mask=qn_ok)
        tl.store(dC_ptr + out, dC.to(dC_ptr.dtype.element_ty), mask=qn_ok)

    @triton.jit
    def ssd_chunk_bwd_group_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dy_ptr, st_ptr, gs_ptr,
                                   dx_ptr, ddt_ptr, dA_ptr, dD_ptr, dB_ptr, dC_ptr,
                                   length, chunks, heads_per_group, head_dim, state_dim, groups,
                                   sx_b, sx_l, sx_h, sdt_b, sdt_l, sB_b, sB_l, sB_g, sC_b, sC_l, sC_g,
                                   sdy_b, sdy_l, sdy_h, sst_b, sst_c, sst_h,
                                   Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
        # Both chunk-parallel kernels in one program per (batch x chunk, group) over the whole state_dim: each
        # head's states and state gradients are read once; C B^T is computed once for the group.
        bc = tl.program_id(0)
        g = tl.program_id(1)
        b, c = bc // chunks, bc % chunks
        heads = groups * heads_per_group
        ns = tl.arange(0, BN)
        n_ok = ns < state_dim
        qs = tl.arange(0, Q)
        rows = c * Q + qs
        row_ok = rows < length
        qn_ok = row_ok[:, None] & n_ok[None, :]
        causal = qs[:, None] >= qs[None, :]
        ps = tl.arange(0, BP)
        Bm = tl.load(B_ptr + b.to(tl.int64) * sB_b + g * sB_g + rows[:, None] * sB_l + ns[None, :], mask=qn_ok,
                     other=0.0)
        Cm = tl.load(C_ptr + b.to(tl.int64) * sC_b + g * sC_g + rows[:, None] * sC_l + ns[None, :], mask=qn_ok,
                     other=0.0).to(Bm.dtype)
        cb = tl.dot(Cm, tl.trans(Bm), input_precision=PREC)
        dB = tl.zeros([Q, BN], dtype=tl.float32)
        dC = tl.zeros([Q, BN], dtype=tl.float32)
        w = tl.zeros([Q, Q], dtype=tl.float32)
        for hh in range(heads_per_group):
            h = g * heads_per_group + hh
            A = tl.load(A_ptr + h)
            dt = tl.load(dt_ptr + b.to(tl.int64) * sdt_b + rows * sdt_l + h, mask=row_ok, other=0.0).to(tl.float32)
            a = dt * A
            cum = tl.cumsum(a, 0)
            last = tl.sum(a, 0)
            e_in = tl.exp(cum)
            to_end = tl.exp(last - cum)
            decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
            s = cb * decay
            dcum = tl.zeros([Q], dtype=tl.float32)
            ddt_x = tl.zeros([Q], dtype=tl.float32)
            d_to_end_sum = tl.zeros([Q], dtype=tl.float32)
            gs_prev = tl.zeros([BP], dtype=tl.float32)
            x_rows = x_ptr + b.to(tl.int64) * sx_b + h * sx_h + rows[:, None] * sx_l
            dy_rows = dy_ptr + b.to(tl.int64) * sdy_b + h * sdy_h + rows[:, None] * sdy_l
            st_offs = b.to(tl.int64) * sst_b + c * sst_c + h * sst_h + ns[None, :]
            for p0 in range(0, head_dim, BP):
                cols = p0 + ps
                col_ok = cols < head_dim
                qp_ok = row_ok[:, None] & col_ok[None, :]
                pn_ok = col_ok[:, None] & n_ok[None, :]
                x = tl.load(x_rows + cols[None, :], mask=qp_ok, other=0.0)
                dy = tl.load(dy_rows + cols[None, :], mask=qp_ok, other=0.0)
                prev = tl.load(st_ptr + st_offs + cols[:, None] * state_dim, mask=pn_ok, other=0.0)
                grad_state = tl.load(gs_ptr + st_offs + cols[:, None] * state_dim, mask=pn_ok, other=0.0)
                gs_prev += tl.sum(grad_state.to(tl.float32) * prev.to(tl.float32), 1)
                prev16 = prev.to(Bm.dtype)
                gs16 = grad_state.to(Bm.dtype)
                xf = x.to(tl.float32)
                dyf = dy.to(tl.float32)
                xdt = xf * dt[:, None]
                gb = tl.dot(Bm, tl.trans(gs16), input_precision=PREC)
                d_xdt = tl.dot(tl.trans(s.to(Bm.dtype)), dy.to(Bm.dtype), input_precision=PREC)
                d_xdt += to_end[:, None] * gb
                ds = tl.dot(dy.to(Bm.dtype), tl.trans(xdt.to(Bm.dtype)), input_precision=PREC)
                m = tl.where(causal, ds * s, 0.0)
                dcum += tl.sum(m, 1) - tl.sum(m, 0)
                w += tl.where(causal, ds * decay, 0.0)
                cp = tl.dot(Cm, tl.trans(prev16), input_precision=PREC)
                dcum += e_in * tl.sum(dyf * cp, 1)
                d_to_end_sum += tl.sum(xdt * gb, 1)
                ddt_x += tl.sum(d_xdt * xf, 1)
                Dv = tl.load(D_ptr + h * head_dim + cols, mask=col_ok, other=0.0)
                tl.store(dx_ptr + b.to(tl.int64) * sdy_b + h * sdy_h + rows[:, None] * sdy_l + cols[None, :],
                         (d_xdt * dt[:, None] + Dv[None, :] * dyf).to(dx_ptr.dtype.element_ty), mask=qp_ok)
                tl.store(dD_ptr + (bc * heads + h).to(tl.int64) * head_dim + cols, tl.sum(dyf * xf, 0), mask=col_ok)
                dC += tl.dot((dyf * e_in[:, None]).to(Bm.dtype), prev16, input_precision=PREC)
                dB += tl.dot((xdt * to_end[:, None]).to(Bm.dtype), gs16, input_precision=PREC)
            d_to_end = d_to_end_sum * to_end
            dcum -= d_to_end
            d_last = tl.sum(d_to_end, 0) + tl.exp(last) * tl.sum(gs_prev, 0)
            da = tl.sum(dcum, 0) - tl.cumsum(dcum, 0) + dcum + d_last
            tl.store(ddt_ptr + (b.to(tl.int64) * length + rows) * heads + h, ddt_x + da * A, mask=row_ok)
            tl.store(dA_ptr + bc * heads + h, tl.sum(da * dt, 0))
        w16 = w.to(Bm.dtype)
        dC += tl.dot(w16, Bm, input_precision=PREC)
        dB += tl.dot(tl.trans(w16), Cm, input_precision=PREC)
        out = (b.to(tl.int64) * length + rows[:, None]) * groups * state_dim + g * state_dim + ns[None, :]
        tl.store(dB_ptr + out, dB.to(dB_ptr.dtype.element_ty), mask=qn_ok)
        tl.store(dC_ptr + out, dC.to(dC_ptr.dtype.element_ty), mask=qn_ok)

    return ssd_state_grad_kernel, ssd_chunk_dx_kernel, ssd_chunk_dbc_kernel, ssd_chunk_bwd_group_kernel
