"""The Mamba mixer's decode step (one token per sequence) as two Triton kernels that update the state slots in place.

:func:`~megatron_core.ssm.mamba_inference.conv_step` and :func:`~megatron_core.ssm.mamba_inference.ssm_step` (the
CPU path and the reference) run as many small PyTorch kernels per layer, on states gathered from the slots and
copied back. Here each decode row names its slot (``slots[t]``) and the kernels read and write the slot tensors
directly (no gather, no ``index_copy_``, no host synchronisation: a captured CUDA graph replays them as they are):

* ``conv_update_kernel``, per ``(row, block of channels)``: shifts the row's convolution window ``[ch, K]`` left by
  one, appends the token's ``x, B, C`` (read in place from ``in_proj``'s output row), writes the window back and
  ``silu(bias + sum(window * w))`` to a ``[rows, ch]`` buffer in the activations' dtype (as ``conv_step`` rounds);
* ``ssm_update_kernel``, per ``(row, head, block of head_dim)``: ``dt = softplus(dt + dt_bias)``,
  ``A = -exp(A_log)``, ``h = exp(dt A) h + dt x B^T`` on the head's ``[block, d_state]`` state tile (its group's
  ``B``/``C``), writes ``h`` back and ``y = h C + D x``.

fp32 math; the states are stored in the slots' dtype. Several rows naming the same slot (the padding rows of a
graph step on the scratch slot) leave that slot undefined, as any other order of their updates would. Triton is
loaded through :mod:`megatron_core.jit` only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, next_power_of_two, triton_modules

__all__ = ["DECODE_BLOCKS", "mamba_decode_step", "mamba_decode_supported"]

# ``conv_ch``: channels per convolution program; ``ssm_p``: head_dim rows of the state per SSM program.
DECODE_BLOCKS: dict[str, int] = {"conv_ch": 128, "conv_warps": 4, "ssm_p": 16, "ssm_warps": 4}
_MAX_DIM = 256  # head_dim and d_state up to this


def mamba_decode_supported(rows: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor) -> bool:
    """Whether :func:`mamba_decode_step` serves these tensors: all on CUDA, floating dtypes, unit last strides,
    ``head_dim`` and ``d_state`` <= 256, Triton installed."""
    return (rows.is_cuda and conv_states.is_cuda and ssm_states.is_cuda
            and rows.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and ssm_states.shape[-1] <= _MAX_DIM and ssm_states.shape[-2] <= _MAX_DIM
            and rows.stride(-1) == 1 and conv_states.stride(-1) == 1 and ssm_states[0].is_contiguous()
            and have_triton())


@functools.cache
def _kernels() -> tuple[Any, Any]:
    triton, tl = triton_modules()

    @triton.jit
    def conv_update_kernel(xbc_ptr, slot_ptr, state_ptr, w_ptr, bias_ptr, out_ptr, channels,
                           s_xt, s_sb, s_sc, s_wc, s_ot, K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr):
        t = tl.program_id(0)
        ch = tl.program_id(1) * BC + tl.arange(0, BC)
        ch_ok = ch < channels
        ks = tl.arange(0, KP)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        base = state_ptr + slot * s_sb + ch[:, None] * s_sc + ks[None, :]
        # The new window: the old one's columns 1..K-1, then the token's input.
        shifted = tl.load(base + 1, mask=ch_ok[:, None] & (ks[None, :] < K - 1), other=0.0).to(tl.float32)
        x = tl.load(xbc_ptr + t.to(tl.int64) * s_xt + ch, mask=ch_ok, other=0.0).to(tl.float32)
        window = tl.where(ks[None, :] == K - 1, x[:, None], shifted)
        w = tl.load(w_ptr + ch[:, None] * s_wc + ks[None, :], mask=ch_ok[:, None] & (ks[None, :] < K),
                    other=0.0).to(tl.float32)
        acc = tl.sum(window * w, 1) + tl.load(bias_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)
        out = acc / (1.0 + tl.exp(-acc))
        tl.debug_barrier()  # every thread's loads of the old window before any store over it
        tl.store(base, window.to(state_ptr.dtype.element_ty), mask=ch_ok[:, None] & (ks[None, :] < K))
        tl.store(out_ptr + t.to(tl.int64) * s_ot + ch, out.to(out_ptr.dtype.element_ty), mask=ch_ok)

    @triton.jit
    def ssm_update_kernel(xbc_ptr, dt_ptr, slot_ptr, state_ptr, dt_bias_ptr, A_log_ptr, D_ptr, y_ptr,
                          heads_per_group, groups, head_dim, state_dim, d_inner, s_xt, s_dtt, s_sb, s_sh, s_yt, s_yh,
                          BP: tl.constexpr, BN: tl.constexpr, D_HAS_P: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        g = h // heads_per_group
        cols = tl.program_id(2) * BP + tl.arange(0, BP)
        col_ok = cols < head_dim
        ns = tl.arange(0, BN)
        n_ok = ns < state_dim
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dt = tl.load(dt_ptr + t.to(tl.int64) * s_dtt + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))  # softplus (torch's threshold)
        A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
        row = xbc_ptr + t.to(tl.int64) * s_xt
        x = tl.load(row + h * head_dim + cols, mask=col_ok, other=0.0).to(tl.float32)
        Bv = tl.load(row + d_inner + g * state_dim + ns, mask=n_ok, other=0.0).to(tl.float32)
        Cv = tl.load(row + d_inner + (groups + g) * state_dim + ns, mask=n_ok, other=0.0).to(tl.float32)
        tile_ok = col_ok[:, None] & n_ok[None, :]
        base = state_ptr + slot * s_sb + h * s_sh + cols[:, None] * state_dim + ns[None, :]
        state = tl.load(base, mask=tile_ok, other=0.0).to(tl.float32)
        state = state * tl.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
        if D_HAS_P:
            Dv = tl.load(D_ptr + h * head_dim + cols, mask=col_ok, other=0.0).to(tl.float32)
        else:
            Dv = tl.load(D_ptr + h).to(tl.float32)
        y = tl.sum(state * Cv[None, :], 1) + Dv * x
        tl.debug_barrier()  # every thread's loads of the old state before any store over it
        tl.store(base, state.to(state_ptr.dtype.element_ty), mask=tile_ok)
        tl.store(y_ptr + t.to(tl.int64) * s_yt + h * s_yh + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)

    return conv_update_kernel, ssm_update_kernel


def _decode_step(xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor, conv_states: torch.Tensor,
                 ssm_states: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor, dt_bias: torch.Tensor,
                 A_log: torch.Tensor, D: torch.Tensor, groups: int) -> torch.Tensor:
    rows, channels = slots.shape[0], conv_states.shape[1]
    heads, head_dim, state_dim = ssm_states.shape[1:]
    d_inner = heads * head_dim
    kernel = conv_states.shape[2]
    conv_kernel, ssm_kernel = _kernels()
    weight = conv_weight.reshape(channels, kernel)
    conv_out = torch.empty(rows, channels, device=xbc.device, dtype=xbc.dtype)
    y = torch.empty(rows, heads, head_dim, device=xbc.device, dtype=xbc.dtype)
    if rows == 0:
        return y
    block_c = min(DECODE_BLOCKS["conv_ch"], next_power_of_two(channels))
    conv_kernel[(rows, -(-channels // block_c))](
        xbc, slots, conv_states, weight, conv_bias, conv_out, channels, xbc.stride(0), conv_states.stride(0),
        conv_states.stride(1), weight.stride(0), conv_out.stride(0), K=kernel, KP=next_power_of_two(kernel),
        BC=block_c, num_warps=DECODE_BLOCKS["conv_warps"])
    block_p = min(DECODE_BLOCKS["ssm_p"], next_power_of_two(head_dim))
    ssm_kernel[(rows, heads, -(-head_dim // block_p))](
        conv_out, dt, slots, ssm_states, dt_bias, A_log, D, y, heads // groups, groups, head_dim, state_dim, d_inner,
        conv_out.stride(0), dt.stride(0), ssm_states.stride(0), ssm_states.stride(1), y.stride(0), y.stride(1),
        BP=block_p, BN=next_power_of_two(state_dim), D_HAS_P=D.numel() == d_inner,
        num_warps=DECODE_BLOCKS["ssm_warps"])
    return y


@torch.library.custom_op("megatron_core::mamba_decode_step", mutates_args=("conv_states", "ssm_states"))
def _decode_step_op(xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor, conv_states: torch.Tensor,
                    ssm_states: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor, dt_bias: torch.Tensor,
                    A_log: torch.Tensor, D: torch.Tensor, groups: int) -> torch.Tensor:
    return _decode_step(xbc, dt, slots, conv_states, ssm_states, conv_weight, conv_bias, dt_bias, A_log, D, groups)


@_decode_step_op.register_fake
def _decode_step_fake(xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor, conv_states: torch.Tensor,
                      ssm_states: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor,
                      dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, groups: int) -> torch.Tensor:
    return xbc.new_empty(slots.shape[0], ssm_states.shape[1], ssm_states.shape[2])


def mamba_decode_step(xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor, conv_states: torch.Tensor,
                      ssm_states: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor,
                      dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, groups: int) -> torch.Tensor:
    """One token of each decode row through the convolution and the SSM; returns ``y`` ``[rows, h, p]`` (before
    the gate and the norm) in ``xbc``'s dtype and updates both states of every row's slot in place.

    ``xbc`` ``[rows, >= ch]``: each row's ``x, B, C`` (the first ``ch`` columns; unit last stride, e.g. a column
    slice of ``in_proj``'s output); ``dt`` ``[rows, >= h]``: the raw ``dt`` (before ``dt_bias`` and softplus);
    ``slots`` ``[rows]`` (int64) into ``conv_states`` ``[slots, ch, K]`` and ``ssm_states`` ``[slots, h, p, n]``;
    ``conv_weight`` ``[ch, 1, K]`` (or ``[ch, K]``), ``conv_bias`` ``[ch]``, ``dt_bias``/``A_log`` ``[h]``,
    ``D`` ``[h]`` or ``[h, p]`` (contiguous), ``groups``: the ``B``/``C`` groups. Check
    :func:`mamba_decode_supported` first.
    """
    args = (xbc, dt, slots, conv_states, ssm_states, conv_weight, conv_bias, dt_bias, A_log, D, groups)
    if torch.compiler.is_compiling():
        return torch.ops.megatron_core.mamba_decode_step(*args)
    return _decode_step(*args)
