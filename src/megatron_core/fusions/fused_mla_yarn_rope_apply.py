"""RoPE on multi-latent attention's query and key, one kernel each way (Megatron-Core's ``fused_mla_yarn_rope_apply``).

MLA's last ``emb_dim`` channels of each query head, and the ``emb_dim`` key channels shared by every head
(``k_pos_emb``), come as interleaved pairs ``(x0, x1), (x2, x3), ...``; they are rotated into the half-split layout
``left = x_even * cos[:h] - x_odd * sin[:h]``, ``right = x_odd * cos[h:] + x_even * sin[h:]`` (``h = emb_dim / 2``),
the same values as ``transformer.mla_rope.rotate_mla``. ``cos`` / ``sin`` are the tables ``[max_seq_len, 1, 1,
emb_dim]`` with YaRN's scale already in them.

* :func:`fused_apply_mla_rope_for_q` rotates ``t [s, b, heads, qk_head_dim + emb_dim]`` (or ``[t, heads, ...]``
  packed) **in place** and returns it; its backward writes a new gradient tensor.
* :func:`fused_apply_mla_rope_for_kv` splits ``kv [.., heads, k_dim + v_dim]`` into the key ``[.., heads, k_dim +
  emb_dim]`` (the shared rotated channels appended to every head) and the value ``[.., heads, v_dim]``, both new
  contiguous tensors; its backward sums the shared channels' gradient over the heads.

Packed sequences (``cu_seqlens``, the padded offsets of the whole sequence) restart the positions per document;
under context parallelism this rank holds chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of each document,
and ``cos`` / ``sin`` must cover the longest document (not CP-split). Rows past the last document, or whose
position the table does not hold, keep their values (channels reordered, not rotated).

On CUDA with Triton the kernels ``rotary_fwd_q_kernel``, ``rotary_bwd_q_kernel``, ``rotary_fwd_kv_kernel`` and
``rotary_bwd_kv_kernel`` run (module attributes, built on first use); elsewhere the same arithmetic in PyTorch ops.
Both compute in fp32 with one rounding per output. Differences from Megatron-Core: any even ``emb_dim`` (it asks
for a multiple of 4) and head count (its last block of heads could write past the row), no autotuning, the query's
backward leaves the incoming gradient untouched, and errors are ``ValueError`` instead of assertions.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, next_power_of_two, triton_modules, triton_op

__all__ = ["ApplyMLARotaryEmbKV", "ApplyMLARotaryEmbQ", "fused_apply_mla_rope_for_kv", "fused_apply_mla_rope_for_q"]

_KERNEL_NAMES = ("rotary_fwd_q_kernel", "rotary_bwd_q_kernel", "rotary_fwd_kv_kernel", "rotary_bwd_kv_kernel")
_MAX_HEAD_BLOCK = 16  # heads per step of a row's loop
_MAX_CHANNEL_BLOCK = 128  # channels per step of the copies


def _kernels_serve(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for ``t`` (CUDA, Triton installed, a torch with ``triton_op``)."""
    return t.is_cuda and _Q_FORWARD_OP is not None and have_triton()


def __getattr__(name: str) -> Any:
    """Megatron-Core's kernel names, built on first access (Triton must be installed)."""
    if name in _KERNEL_NAMES:
        if triton_modules() is None:
            raise AttributeError(f"{__name__}.{name} is a Triton kernel and Triton is not installed")
        return dict(zip(_KERNEL_NAMES, _kernels()))[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _kernels() -> tuple[Any, Any, Any, Any]:
    triton, tl = triton_modules()
    # Triton resolves a kernel's helper functions among its module's globals (a closure is not seen).
    global _row_table

    @triton.jit
    def _row_table(cos_ptr, sin_ptr, pos_ptr, row, batch, table_rows, HALF: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, HAS_POS: tl.constexpr):
        # This row's position and its cosines and sines (left and right halves); 1 and 0 outside the table.
        if HAS_POS:
            row_position = tl.load(pos_ptr + row).to(tl.int64)
        else:
            row_position = row // batch
        i = tl.arange(0, BLOCK_HALF)
        position = row_position + tl.zeros([BLOCK_HALF], dtype=tl.int64)  # per lane (the interpreter needs it)
        held = (i < HALF) & (position >= 0) & (position < table_rows)
        base = position * (2 * HALF) + i
        cos_l = tl.load(cos_ptr + base, mask=held, other=1.0).to(tl.float32)
        cos_r = tl.load(cos_ptr + base + HALF, mask=held, other=1.0).to(tl.float32)
        sin_l = tl.load(sin_ptr + base, mask=held, other=0.0).to(tl.float32)
        sin_r = tl.load(sin_ptr + base + HALF, mask=held, other=0.0).to(tl.float32)
        return cos_l, cos_r, sin_l, sin_r

    @triton.jit
    def rotary_fwd_q_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, heads, batch, table_rows, stride_s, stride_b,
                            stride_h, qk_head_dim, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                            BLOCK_H: tl.constexpr, HAS_POS: tl.constexpr):
        # One program per token row (s, b), in place: the rope channels of every head, BLOCK_H heads at a time.
        row = tl.program_id(0).to(tl.int64)
        cos_l, cos_r, sin_l, sin_r = _row_table(cos_ptr, sin_ptr, pos_ptr, row, batch, table_rows, HALF,
                                                BLOCK_HALF, HAS_POS)
        i = tl.arange(0, BLOCK_HALF)[None, :]
        base = x_ptr + (row // batch) * stride_s + (row % batch) * stride_b + qk_head_dim
        for h0 in range(0, heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)[:, None]
            mask = (h < heads) & (i < HALF)
            ptr = base + h.to(tl.int64) * stride_h
            x1 = tl.load(ptr + 2 * i, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(ptr + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
            left = x1 * cos_l[None, :] - x2 * sin_l[None, :]
            right = x2 * cos_r[None, :] + x1 * sin_r[None, :]
            tl.debug_barrier()  # the block is read by every lane before any lane writes over it
            tl.store(ptr + i, left.to(x_ptr.dtype.element_ty), mask=mask)
            tl.store(ptr + HALF + i, right.to(x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rotary_bwd_q_kernel(g_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, heads, batch, table_rows, stride_s,
                            stride_b, stride_h, qk_head_dim, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_POS: tl.constexpr):
        # The adjoint rotation into a new contiguous gradient; the other channels are copied.
        row = tl.program_id(0).to(tl.int64)
        cos_l, cos_r, sin_l, sin_r = _row_table(cos_ptr, sin_ptr, pos_ptr, row, batch, table_rows, HALF,
                                                BLOCK_HALF, HAS_POS)
        i = tl.arange(0, BLOCK_HALF)[None, :]
        d = tl.arange(0, BLOCK_D)[None, :]
        width = qk_head_dim + 2 * HALF
        src = g_ptr + (row // batch) * stride_s + (row % batch) * stride_b
        dst = out_ptr + row * heads * width
        for h0 in range(0, heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)[:, None]
            live_h = h < heads
            src_h = src + h.to(tl.int64) * stride_h
            dst_h = dst + h.to(tl.int64) * width
            for d0 in range(0, qk_head_dim, BLOCK_D):
                copy = live_h & (d0 + d < qk_head_dim)
                tl.store(dst_h + d0 + d, tl.load(src_h + d0 + d, mask=copy), mask=copy)
            mask = live_h & (i < HALF)
            g_l = tl.load(src_h + qk_head_dim + i, mask=mask, other=0.0).to(tl.float32)
            g_r = tl.load(src_h + qk_head_dim + HALF + i, mask=mask, other=0.0).to(tl.float32)
            x1 = g_l * cos_l[None, :] + g_r * sin_r[None, :]
            x2 = g_r * cos_r[None, :] - g_l * sin_l[None, :]
            tl.store(dst_h + qk_head_dim + 2 * i, x1.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(dst_h + qk_head_dim + 2 * i + 1, x2.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rotary_fwd_kv_kernel(kv_ptr, emb_ptr, key_ptr, value_ptr, cos_ptr, sin_ptr, pos_ptr, heads, batch,
                             table_rows, kv_stride_s, kv_stride_b, kv_stride_h, emb_stride_s, emb_stride_b, k_dim,
                             v_dim, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_D: tl.constexpr, HAS_POS: tl.constexpr):
        # One program per token row: rotate the shared channels once, then write every head's key and value.
        row = tl.program_id(0).to(tl.int64)
        s, b = row // batch, row % batch
        cos_l, cos_r, sin_l, sin_r = _row_table(cos_ptr, sin_ptr, pos_ptr, row, batch, table_rows, HALF,
                                                BLOCK_HALF, HAS_POS)
        lane = tl.arange(0, BLOCK_HALF)
        emb = emb_ptr + s * emb_stride_s + b * emb_stride_b
        x1 = tl.load(emb + 2 * lane, mask=lane < HALF, other=0.0).to(tl.float32)
        x2 = tl.load(emb + 2 * lane + 1, mask=lane < HALF, other=0.0).to(tl.float32)
        zeros = tl.zeros([BLOCK_H, BLOCK_HALF], dtype=tl.float32)
        left = ((x1 * cos_l - x2 * sin_l)[None, :] + zeros).to(key_ptr.dtype.element_ty)
        right = ((x2 * cos_r + x1 * sin_r)[None, :] + zeros).to(key_ptr.dtype.element_ty)
        i = lane[None, :]
        d = tl.arange(0, BLOCK_D)[None, :]
        key_width = k_dim + 2 * HALF
        src = kv_ptr + s * kv_stride_s + b * kv_stride_b
        for h0 in range(0, heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)[:, None]
            live_h = h < heads
            src_h = src + h.to(tl.int64) * kv_stride_h
            key_h = key_ptr + (row * heads + h) * key_width
            value_h = value_ptr + (row * heads + h) * v_dim
            for d0 in range(0, k_dim, BLOCK_D):
                copy = live_h & (d0 + d < k_dim)
                tl.store(key_h + d0 + d, tl.load(src_h + d0 + d, mask=copy), mask=copy)
            for d0 in range(0, v_dim, BLOCK_D):
                copy = live_h & (d0 + d < v_dim)
                tl.store(value_h + d0 + d, tl.load(src_h + k_dim + d0 + d, mask=copy), mask=copy)
            mask = live_h & (i < HALF)
            tl.store(key_h + k_dim + i, left, mask=mask)
            tl.store(key_h + k_dim + HALF + i, right, mask=mask)

    @triton.jit
    def rotary_bwd_kv_kernel(dk_ptr, dv_ptr, dkv_ptr, demb_ptr, cos_ptr, sin_ptr, pos_ptr, heads, batch,
                             table_rows, dk_stride_s, dk_stride_b, dk_stride_h, dv_stride_s, dv_stride_b,
                             dv_stride_h, k_dim, v_dim, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_POS: tl.constexpr):
        # One program per token row: kv's gradient per head, and the shared channels' gradient summed over heads.
        row = tl.program_id(0).to(tl.int64)
        s, b = row // batch, row % batch
        cos_l, cos_r, sin_l, sin_r = _row_table(cos_ptr, sin_ptr, pos_ptr, row, batch, table_rows, HALF,
                                                BLOCK_HALF, HAS_POS)
        i = tl.arange(0, BLOCK_HALF)[None, :]
        d = tl.arange(0, BLOCK_D)[None, :]
        dk_row = dk_ptr + s * dk_stride_s + b * dk_stride_b
        dv_row = dv_ptr + s * dv_stride_s + b * dv_stride_b
        acc_l = tl.zeros([BLOCK_H, BLOCK_HALF], dtype=tl.float32)
        acc_r = tl.zeros([BLOCK_H, BLOCK_HALF], dtype=tl.float32)
        for h0 in range(0, heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)[:, None]
            live_h = h < heads
            dk_h = dk_row + h.to(tl.int64) * dk_stride_h
            dv_h = dv_row + h.to(tl.int64) * dv_stride_h
            dkv_h = dkv_ptr + (row * heads + h) * (k_dim + v_dim)
            for d0 in range(0, k_dim, BLOCK_D):
                copy = live_h & (d0 + d < k_dim)
                tl.store(dkv_h + d0 + d, tl.load(dk_h + d0 + d, mask=copy), mask=copy)
            for d0 in range(0, v_dim, BLOCK_D):
                copy = live_h & (d0 + d < v_dim)
                tl.store(dkv_h + k_dim + d0 + d, tl.load(dv_h + d0 + d, mask=copy), mask=copy)
            mask = live_h & (i < HALF)
            acc_l += tl.load(dk_h + k_dim + i, mask=mask, other=0.0).to(tl.float32)
            acc_r += tl.load(dk_h + k_dim + HALF + i, mask=mask, other=0.0).to(tl.float32)
        g_l = tl.sum(acc_l, 0)
        g_r = tl.sum(acc_r, 0)
        x1 = g_l * cos_l + g_r * sin_r
        x2 = g_r * cos_r - g_l * sin_l
        j = tl.arange(0, BLOCK_HALF)
        demb = demb_ptr + row * (2 * HALF)
        tl.store(demb + 2 * j, x1.to(demb_ptr.dtype.element_ty), mask=j < HALF)
        tl.store(demb + 2 * j + 1, x2.to(demb_ptr.dtype.element_ty), mask=j < HALF)

    return rotary_fwd_q_kernel, rotary_bwd_q_kernel, rotary_fwd_kv_kernel, rotary_bwd_kv_kernel


def _blocks(heads: int, half: int, *widths: int) -> dict[str, int]:
    """Block sizes of a launch: heads per step, the half rope width, channels per copy step."""
    blocks = {"BLOCK_H": min(next_power_of_two(max(heads, 1)), _MAX_HEAD_BLOCK),
              "BLOCK_HALF": next_power_of_two(half)}
    if widths:
        blocks["BLOCK_D"] = min(next_power_of_two(max(*widths, 1)), _MAX_CHANNEL_BLOCK)
    return blocks


def _q_forward_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
                      qk_head_dim: int) -> None:
    s, b, heads, width = x.shape
    half = (width - qk_head_dim) // 2
    if x.numel():
        torch.library.wrap_triton(_kernels()[0])[(s * b,)](
            x, cos, sin, positions if positions is not None else cos, heads, b, cos.shape[0], x.stride(0),
            x.stride(1), x.stride(2), qk_head_dim, HALF=half, HAS_POS=positions is not None, num_warps=4,
            **_blocks(heads, half),
        )


def _q_backward_kernel(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
                       qk_head_dim: int) -> torch.Tensor:
    s, b, heads, width = grad.shape
    half = (width - qk_head_dim) // 2
    out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    if out.numel():
        torch.library.wrap_triton(_kernels()[1])[(s * b,)](
            grad, out, cos, sin, positions if positions is not None else cos, heads, b, cos.shape[0],
            grad.stride(0), grad.stride(1), grad.stride(2), qk_head_dim, HALF=half, HAS_POS=positions is not None,
            num_warps=4, **_blocks(heads, half, qk_head_dim),
        )
    return out


def _kv_forward_kernel(kv: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor | None, k_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    s, b, heads, _ = kv.shape
    half = emb.shape[-1] // 2
    key = kv.new_empty(s, b, heads, k_dim + 2 * half)
    value = kv.new_empty(s, b, heads, v_dim)
    if key.numel():
        torch.library.wrap_triton(_kernels()[2])[(s * b,)](
            kv, emb, key, value, cos, sin, positions if positions is not None else cos, heads, b, cos.shape[0],
            kv.stride(0), kv.stride(1), kv.stride(2), emb.stride(0), emb.stride(1), k_dim, v_dim, HALF=half,
            HAS_POS=positions is not None, num_warps=4, **_blocks(heads, half, k_dim, v_dim),
        )
    return key, value


def _kv_backward_kernel(dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        positions: torch.Tensor | None, k_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    s, b, heads, _ = dk.shape
    half = (dk.shape[-1] - k_dim) // 2
    dkv = dk.new_empty(s, b, heads, k_dim + v_dim)
    demb = dk.new_empty(s, b, 2 * half)
    if demb.numel():
        torch.library.wrap_triton(_kernels()[3])[(s * b,)](
            dk, dv, dkv, demb, cos, sin, positions if positions is not None else cos, heads, b, cos.shape[0],
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2), k_dim, v_dim,
            HALF=half, HAS_POS=positions is not None, num_warps=4, **_blocks(heads, half, k_dim, v_dim),
        )
    return dkv, demb


# Registered at import where Triton is installed (the kernels are built on their first launch).
_Q_FORWARD_OP = triton_op("megatron_core::mla_rope_q_forward", _q_forward_kernel, mutates_args=("x",))
_Q_BACKWARD_OP = triton_op("megatron_core::mla_rope_q_backward", _q_backward_kernel)
_KV_FORWARD_OP = triton_op("megatron_core::mla_rope_kv_forward", _kv_forward_kernel)
_KV_BACKWARD_OP = triton_op("megatron_core::mla_rope_kv_backward", _kv_backward_kernel)


# ---- the same arithmetic in PyTorch ops ------------------------------------------------------------------------
def _row_angles(cos: torch.Tensor, sin: torch.Tensor, rows: int, positions: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cosines and sines ``[rows, 1, 1, emb_dim]`` of each row (1 and 0 where the table holds no position)."""
    if positions is None:
        return cos[:rows, None, None, :].float(), sin[:rows, None, None, :].float()
    held = ((positions >= 0) & (positions < cos.shape[0]))[:, None]
    index = positions.clamp(0, cos.shape[0] - 1).long()
    c = torch.where(held, cos[index].float(), 1.0)
    s = torch.where(held, sin[index].float(), 0.0)
    return c[:, None, None, :], s[:, None, None, :]


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs of ``x`` rotated into the half-split layout (fp32)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat((x1 * c[..., :half] - x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:]), dim=-1)


def _unrotate(g: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The adjoint of :func:`_rotate`: a half-split gradient back to interleaved pairs (fp32)."""
    half = g.shape[-1] // 2
    g_l, g_r = g[..., :half].float(), g[..., half:].float()
    x1 = g_l * c[..., :half] + g_r * s[..., half:]
    x2 = g_r * c[..., half:] - g_l * s[..., :half]
    return torch.stack((x1, x2), dim=-1).flatten(-2)


def _q_forward_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
                     qk_head_dim: int) -> None:
    c, s = _row_angles(cos, sin, x.shape[0], positions)
    pe = x[..., qk_head_dim:]
    pe.copy_(_rotate(pe, c, s))


def _q_backward_torch(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
                      qk_head_dim: int) -> torch.Tensor:
    c, s = _row_angles(cos, sin, grad.shape[0], positions)
    out = grad.clone(memory_format=torch.contiguous_format)
    out[..., qk_head_dim:] = _unrotate(grad[..., qk_head_dim:], c, s)
    return out


def _kv_forward_torch(kv: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor | None, k_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    c, s = _row_angles(cos, sin, kv.shape[0], positions)
    rotated = _rotate(emb.unsqueeze(2), c, s).to(kv.dtype)  # [s, b, 1, emb_dim]
    key = torch.cat((kv[..., :k_dim], rotated.expand(*kv.shape[:3], rotated.shape[-1])), dim=-1)
    return key, kv[..., k_dim:].clone(memory_format=torch.contiguous_format)


def _kv_backward_torch(dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor | None, k_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    c, s = _row_angles(cos, sin, dk.shape[0], positions)
    dkv = torch.cat((dk[..., :k_dim], dv), dim=-1)
    shared = dk[..., k_dim:].float().sum(dim=2, keepdim=True)
    return dkv, _unrotate(shared, c, s).squeeze(2).to(dk.dtype)


# ---- shapes, positions and the autograd functions ---------------------------------------------------------------
def _thd_positions(cu_seqlens: torch.Tensor, rows: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Each local packed row's position in its document (int32, ``-1`` past the last document), on the device."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor of at least 2 offsets, got shape "
                         f"{tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}")
    bounds = cu_seqlens.to(torch.int64) // cp_size  # this rank's share of every document
    token = torch.arange(rows, device=cu_seqlens.device)
    doc = torch.searchsorted(bounds[1:].contiguous(), token, right=True)
    past_end = doc >= bounds.numel() - 1
    doc = doc.clamp(max=bounds.numel() - 2)
    start, length = bounds[doc], bounds[doc + 1] - bounds[doc]
    local = token - start
    if cp_size > 1:  # the first half is chunk cp_rank of the document, the second chunk 2 * cp_size - 1 - cp_rank
        half = length // 2
        local = torch.where(local < half, local + cp_rank * half, local - half + (2 * cp_size - 1 - cp_rank) * half)
    return torch.where(past_end, -1, local).to(torch.int32)


def _tables(cos: torch.Tensor, sin: torch.Tensor, emb_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` / ``sin`` as contiguous ``[max_seq_len, emb_dim]``."""
    if cos.shape != sin.shape or cos.shape[-1] != emb_dim:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape, [max_seq_len, 1, "
                         f"1, emb_dim] with emb_dim {emb_dim}")
    return cos.reshape(-1, emb_dim).contiguous(), sin.reshape(-1, emb_dim).contiguous()


def _check_common(emb_dim: int, rotary_interleaved: bool, cp_rank: int, cp_size: int) -> None:
    if emb_dim <= 0 or emb_dim % 2:
        raise ValueError(f"emb_dim ({emb_dim}) must be a positive even number (the rotated channel pairs)")
    if rotary_interleaved:
        raise ValueError("rotary_interleaved=True is not supported by the fused MLA RoPE (nor by Megatron-Core's)")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank ({cp_rank}) must be in [0, cp_size ({cp_size}))")


def _as_rows(t: torch.Tensor, packed: bool, name: str, width: int) -> torch.Tensor:
    """``t`` as ``[s, b, heads, width]`` (a packed ``[t, heads, width]`` gets ``b = 1``), a view."""
    if t.dim() != (3 if packed else 4) or t.shape[-1] != width:
        layout = "[total_seq_len, head_num, " if packed else "[seq_len, batch_size, head_num, "
        raise ValueError(f"{name} must be {layout}{width}] ({'thd' if packed else 'sbhd'}), got shape "
                         f"{tuple(t.shape)}")
    return t.unsqueeze(1) if packed else t


def _check_table_covers(cos: torch.Tensor, positions: torch.Tensor | None, seq_len: int) -> None:
    if positions is None and cos.shape[0] < seq_len:
        raise ValueError(f"cos / sin hold {cos.shape[0]} positions, fewer than the sequence's {seq_len}")


class ApplyMLARotaryEmbQ(torch.autograd.Function):
    """RoPE on the last ``emb_dim`` channels of MLA's query heads, in place (see :func:`fused_apply_mla_rope_for_q`)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_head_dim: int, emb_dim: int,
                cu_seqlens_q: torch.Tensor | None, cp_rank: int, cp_size: int, rotary_interleaved: bool = False
                ) -> torch.Tensor:
        """Rotate ``q`` ``[s, b, heads, qk_head_dim + emb_dim]`` (or ``[t, heads, ...]``) in place; return it."""
        _check_common(emb_dim, rotary_interleaved, cp_rank, cp_size)
        packed = cu_seqlens_q is not None
        x = _as_rows(q, packed, "q", qk_head_dim + emb_dim)
        cos, sin = _tables(cos, sin, emb_dim)
        positions = _thd_positions(cu_seqlens_q, x.shape[0], cp_rank, cp_size) if packed else None
        _check_table_covers(cos, positions, x.shape[0])
        if _kernels_serve(q):
            work = x if x.stride(-1) == 1 else x.contiguous()
            _Q_FORWARD_OP(work, cos, sin, positions, qk_head_dim)
            if work is not x:
                x.copy_(work)
        else:
            _q_forward_torch(x, cos, sin, positions, qk_head_dim)
        ctx.save_for_backward(cos, sin, positions)
        ctx.qk_head_dim, ctx.packed = qk_head_dim, packed
        return q

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        """The gradient of ``q`` (a new tensor; ``grad`` is not modified)."""
        cos, sin, positions = ctx.saved_tensors
        g = grad.unsqueeze(1) if ctx.packed else grad
        if _kernels_serve(grad):
            out = _Q_BACKWARD_OP(g if g.stride(-1) == 1 else g.contiguous(), cos, sin, positions, ctx.qk_head_dim)
        else:
            out = _q_backward_torch(g, cos, sin, positions, ctx.qk_head_dim)
        return (out.squeeze(1) if ctx.packed else out), None, None, None, None, None, None, None, None


class ApplyMLARotaryEmbKV(torch.autograd.Function):
    """MLA's key (with the shared rotated channels) and value from ``kv`` (see :func:`fused_apply_mla_rope_for_kv`)."""

    @staticmethod
    def forward(ctx: Any, kv: torch.Tensor, k_pos_emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                emb_dim: int, k_dim: int, v_dim: int, cu_seqlens_kv: torch.Tensor | None, cp_rank: int,
                cp_size: int, rotary_interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key [.., heads, k_dim + emb_dim], value [.., heads, v_dim])``, new contiguous tensors."""
        _check_common(emb_dim, rotary_interleaved, cp_rank, cp_size)
        packed = cu_seqlens_kv is not None
        x = _as_rows(kv, packed, "kv", k_dim + v_dim)
        s, b = x.shape[:2]
        if k_pos_emb.shape[-1] != emb_dim or k_pos_emb.numel() != s * b * emb_dim:
            raise ValueError(f"k_pos_emb must be [seq_len, batch_size, 1, {emb_dim}] or [total_seq_len, 1, "
                             f"{emb_dim}] for kv {tuple(kv.shape)}, got {tuple(k_pos_emb.shape)}")
        emb = k_pos_emb.reshape(s, b, emb_dim)
        cos, sin = _tables(cos, sin, emb_dim)
        positions = _thd_positions(cu_seqlens_kv, s, cp_rank, cp_size) if packed else None
        _check_table_covers(cos, positions, s)
        if _kernels_serve(kv):
            key, value = _KV_FORWARD_OP(x if x.stride(-1) == 1 else x.contiguous(),
                                        emb if emb.stride(-1) == 1 else emb.contiguous(), cos, sin, positions,
                                        k_dim, v_dim)
        else:
            key, value = _kv_forward_torch(x, emb, cos, sin, positions, k_dim, v_dim)
        ctx.save_for_backward(cos, sin, positions)
        ctx.k_dim, ctx.v_dim, ctx.packed, ctx.emb_shape = k_dim, v_dim, packed, k_pos_emb.shape
        if packed:
            return key.squeeze(1), value.squeeze(1)
        return key, value

    @staticmethod
    def backward(ctx: Any, dk: torch.Tensor | None, dv: torch.Tensor | None) -> tuple:
        """The gradients of ``kv`` and ``k_pos_emb`` (the shared channels' gradient summed over the heads)."""
        cos, sin, positions = ctx.saved_tensors
        if dk is None and dv is None:
            return (None,) * 11
        like = dk if dk is not None else dv
        if dk is None:
            dk = like.new_zeros(*like.shape[:-1], ctx.k_dim + cos.shape[-1])
        if dv is None:
            dv = like.new_zeros(*like.shape[:-1], ctx.v_dim)
        if ctx.packed:
            dk, dv = dk.unsqueeze(1), dv.unsqueeze(1)
        if _kernels_serve(dk):
            dkv, demb = _KV_BACKWARD_OP(dk if dk.stride(-1) == 1 else dk.contiguous(),
                                        dv if dv.stride(-1) == 1 else dv.contiguous(), cos, sin, positions,
                                        ctx.k_dim, ctx.v_dim)
        else:
            dkv, demb = _kv_backward_torch(dk, dv, cos, sin, positions, ctx.k_dim, ctx.v_dim)
        dkv = dkv.squeeze(1) if ctx.packed else dkv
        return dkv, demb.reshape(ctx.emb_shape), None, None, None, None, None, None, None, None, None


def fused_apply_mla_rope_for_q(
    t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_head_dim: int, emb_dim: int,
    cu_seqlens_q: torch.Tensor | None = None, cp_rank: int = 0, cp_size: int = 1, rotary_interleaved: bool = False,
) -> torch.Tensor:
    """Rotate the last ``emb_dim`` channels of each head of MLA's query ``t`` in place and return ``t``.

    ``t`` is ``[seq_len, batch_size, head_num, qk_head_dim + emb_dim]`` or, with ``cu_seqlens_q`` (packed),
    ``[total_seq_len, head_num, qk_head_dim + emb_dim]``; ``cos`` / ``sin`` are ``[max_seq_len, 1, 1, emb_dim]``.
    The first ``qk_head_dim`` channels are not touched.
    """
    return ApplyMLARotaryEmbQ.apply(t, cos, sin, qk_head_dim, emb_dim, cu_seqlens_q, cp_rank, cp_size,
                                    rotary_interleaved)


def fused_apply_mla_rope_for_kv(
    kv: torch.Tensor, k_pos_emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, emb_dim: int, k_dim: int,
    v_dim: int, cu_seqlens_kv: torch.Tensor | None = None, cp_rank: int = 0, cp_size: int = 1,
    rotary_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key, value)`` of MLA from ``kv`` ``[.., head_num, k_dim + v_dim]`` and the shared ``k_pos_emb``.

    ``kv`` is ``[seq_len, batch_size, head_num, k_dim + v_dim]`` or, with ``cu_seqlens_kv`` (packed),
    ``[total_seq_len, head_num, k_dim + v_dim]``; ``k_pos_emb`` is ``[seq_len, batch_size, 1, emb_dim]`` or
    ``[total_seq_len, 1, emb_dim]``. The key is ``[.., head_num, k_dim + emb_dim]``: each head's first ``k_dim``
    channels of ``kv``, then the rotated ``k_pos_emb``; the value is the last ``v_dim`` channels of ``kv``.
    """
    return ApplyMLARotaryEmbKV.apply(kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens_kv, cp_rank, cp_size,
                                     rotary_interleaved)
