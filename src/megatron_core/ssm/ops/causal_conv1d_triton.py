"""The convolution's decode step over state slots (Megatron-Core 0.19's ``ssm.ops.causal_conv1d_triton``).

:func:`causal_conv1d_update` advances each row's convolution state ``[dim, state_len]`` by its new tokens, in place:
per token the state is shifted left by one and the token appended, and the output is
``act(bias + sum_k w[:, k] * window[:, k])`` over the last ``width`` inputs (the old state's last ``width - 1``
columns and the token). Rows name their state slot (``conv_state_indices``; a negative index is a padding row:
output zeros, no state touched); ``intermediate_conv_states[slot, s]`` receives the state after token ``s``.

On CUDA with Triton one kernel does it (``causal_conv1d_update_kernel``, ours: one program per ``(row, block of
channels)``, fp32 sums, any width); elsewhere PyTorch. ``causal_conv1d_update_kernel`` is built on first access
(``AttributeError`` without Triton); Triton is loaded through :mod:`megatron_core.jit` only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core.jit import have_triton, kernel_device, next_power_of_two, triton_modules

# ``causal_conv1d_update_kernel`` is provided by ``__getattr__`` (it needs Triton), so it is not in ``__all__``.
__all__ = ["causal_conv1d_update"]

BLOCK_DIM = 64  # channels per program


def __getattr__(name: str) -> Any:
    if name == "causal_conv1d_update_kernel":
        if not have_triton():
            raise AttributeError("causal_conv1d_update_kernel needs Triton, which is not installed")
        return _kernel()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()

    @triton.jit
    def causal_conv1d_update_kernel(x_ptr, state_ptr, int_ptr, w_ptr, bias_ptr, out_ptr, idx_ptr, seq_len, dim,
                                    state_len, width, s_xb, s_xs, s_sb, s_sc, s_ib, s_is, s_ic, s_wc, s_ob, s_os,
                                    SP: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                                    HAS_IDX: tl.constexpr, HAS_INT: tl.constexpr, SILU: tl.constexpr):
        """Conv-state decode step of one row and ``BLOCK`` channels over its ``seq_len`` tokens."""
        row = tl.program_id(0).to(tl.int64)
        ch = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ch_ok = ch < dim
        if HAS_IDX:
            slot = tl.load(idx_ptr + row).to(tl.int64)
        else:
            slot = row
        if slot < 0:  # a padding row
            for s in range(seq_len):
                tl.store(out_ptr + row * s_ob + s * s_os + ch, tl.zeros([BLOCK], dtype=tl.float32), mask=ch_ok)
            return
        # Tile column k holds input k of [old state, token] (state_len + 1 inputs); the window is the last ``width``.
        ks = tl.arange(0, SP)
        first = state_len + 1 - width
        w = tl.load(w_ptr + ch[:, None] * s_wc + (ks[None, :] - first),
                    mask=ch_ok[:, None] & (ks[None, :] >= first) & (ks[None, :] <= state_len), other=0.0)
        w = w.to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)
        else:
            bias = tl.zeros([BLOCK], dtype=tl.float32)
        base = state_ptr + slot * s_sb + ch[:, None] * s_sc + ks[None, :]
        for s in range(seq_len):
            old = tl.load(base, mask=ch_ok[:, None] & (ks[None, :] < state_len), other=0.0)
            x = tl.load(x_ptr + row * s_xb + s * s_xs + ch, mask=ch_ok, other=0.0).to(old.dtype)
            full = tl.where(ks[None, :] == state_len, x[:, None], old)
            acc = tl.sum(full.to(tl.float32) * w, 1) + bias
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            keep = ch_ok[:, None] & (ks[None, :] >= 1) & (ks[None, :] <= state_len)
            tl.debug_barrier()  # every thread's loads of the old state before any store over it
            tl.store(base - 1, full.to(state_ptr.dtype.element_ty), mask=keep)
            if HAS_INT:
                tl.store(int_ptr + slot * s_ib + s * s_is + ch[:, None] * s_ic + ks[None, :] - 1,
                         full.to(int_ptr.dtype.element_ty), mask=keep)
            tl.store(out_ptr + row * s_ob + s * s_os + ch, acc.to(out_ptr.dtype.element_ty), mask=ch_ok)
            tl.debug_barrier()  # the new state stored before the next token loads it

    return causal_conv1d_update_kernel


def _use_silu(silu_activation: bool | str | None) -> bool:
    if silu_activation in (True, "silu"):
        return True
    if silu_activation in (False, None, ""):
        return False
    raise ValueError(f"causal_conv1d_update: silu_activation must be 'silu', True, False or None, "
                     f"got {silu_activation!r}")


def _update_torch(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  silu: bool, indices: torch.Tensor | None, intermediate: torch.Tensor | None) -> torch.Tensor:
    batch, seq_len, dim = x.shape
    state_len, width = conv_state.shape[-1], weight.shape[-1]
    out = torch.zeros_like(x)
    rows = torch.arange(batch, device=x.device)
    slots = rows if indices is None else indices.to(device=x.device, dtype=torch.int64)
    real = (slots >= 0).nonzero().squeeze(1)
    rows, slots = rows[real], slots[real]
    w = weight.reshape(dim, width).float()
    state = conv_state[slots]
    for s in range(seq_len):
        full = torch.cat([state, x[rows, s].to(state.dtype).unsqueeze(-1)], dim=-1)  # [rows, dim, state_len + 1]
        acc = (full[..., -width:].float() * w).sum(-1)
        if bias is not None:
            acc = acc + bias.float()
        out[rows, s] = (F.silu(acc) if silu else acc).to(out.dtype)
        state = full[..., -state_len:]
        if intermediate is not None:
            intermediate[slots, s] = state.to(intermediate.dtype)
    conv_state[slots] = state
    return out


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         silu_activation: bool | str | None, conv_state_indices: torch.Tensor | None,
                         intermediate_conv_states: torch.Tensor | None = None) -> torch.Tensor:
    """Advance the convolution states by ``x`` and return the convolution's output (``x``'s shape and dtype).

    Args:
        x: ``[batch, dim]`` (one token) or ``[batch, seq_len, dim]`` (e.g. speculative tokens).
        conv_state: ``[slots, dim, state_len]`` (``state_len >= width - 1``), updated in place; row ``b`` uses slot
            ``conv_state_indices[b]`` (``b`` when None).
        weight: ``[dim, width]``; bias: ``[dim]`` or None.
        silu_activation: ``"silu"`` (what 0.19's mixer passes) or True for SiLU; False / None for none.
        conv_state_indices: ``[batch]`` integer slots; a negative slot marks a padding row.
        intermediate_conv_states: ``[slots, seq_len, dim, state_len]``: the state after each token, by slot.
    """
    silu = _use_silu(silu_activation)
    single = x.dim() == 2
    x3 = x.unsqueeze(1) if single else x
    batch, seq_len, dim = x3.shape
    width = weight.shape[-1]
    if conv_state.dim() != 3 or conv_state.shape[1] != dim or conv_state.shape[2] < width - 1 \
            or weight.reshape(dim, -1).shape[1] != width:
        raise ValueError(f"causal_conv1d_update: conv_state {tuple(conv_state.shape)} must be (slots, {dim}, "
                         f">= {width - 1}) and weight {tuple(weight.shape)} ({dim}, width)")
    if conv_state.is_cuda and x3.is_cuda and have_triton() and conv_state.stride(-1) == 1:
        out = _update_triton(x3, conv_state, weight.reshape(dim, width), bias, silu, conv_state_indices,
                             intermediate_conv_states)
    else:
        out = _update_torch(x3, conv_state, weight, bias, silu, conv_state_indices, intermediate_conv_states)
    return out.squeeze(1) if single else out


def _update_triton(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   silu: bool, indices: torch.Tensor | None, intermediate: torch.Tensor | None) -> torch.Tensor:
    """The kernel's launch (CUDA tensors, or CPU ones under Triton's interpreter)."""
    batch, seq_len, dim = x.shape
    state_len = conv_state.shape[-1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if batch == 0 or seq_len == 0:
        return out
    weight = weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    if intermediate is not None and intermediate.stride(-1) != 1:
        raise ValueError("causal_conv1d_update: intermediate_conv_states needs a unit last stride")
    inter_strides = intermediate.stride()[:3] if intermediate is not None else (0, 0, 0)
    with kernel_device(x):
        _kernel()[(batch, -(-dim // BLOCK_DIM))](
            x, conv_state, intermediate if intermediate is not None else conv_state, weight,
            bias if bias is not None else weight, out, indices if indices is not None else x, seq_len, dim,
            state_len, weight.shape[-1], x.stride(0), x.stride(1), conv_state.stride(0), conv_state.stride(1),
            *inter_strides, weight.stride(0), out.stride(0), out.stride(1),
            SP=next_power_of_two(state_len + 1), BLOCK=BLOCK_DIM, HAS_BIAS=bias is not None,
            HAS_IDX=indices is not None, HAS_INT=intermediate is not None, SILU=silu)
    return out
