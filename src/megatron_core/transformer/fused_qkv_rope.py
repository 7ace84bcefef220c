"""The fused QKV projection's output split into query, key and value, with RoPE applied, in one kernel each way.

``linear_qkv`` produces ``[s, b, groups * (heads_per_group + 2) * head_dim]``: per query group, its query heads,
then one key head and one value head. Unfused, attention splits that tensor into strided views, rotates the
query and the key (each a kernel reading and writing its tensor), and the backward concatenates the three
gradients into one. Under ``torch.compile`` Inductor fuses these into two or three kernels that run about
3x slower than their memory traffic allows (about 2.6 ms per step of the 22-layer reference model on an H100).

:func:`split_qkv_with_rope` does the forward in one pass over the projection's output (the query and key
rotated, the value copied, each written contiguous ``[s, b, heads, head_dim]``) and the backward in one pass
that writes the projection's gradient. It is Megatron-Core's ``fused_single_qkv_rope`` (Transformer Engine's
``apply_fused_qkv_rotary_pos_emb`` there), written in Triton: CUDA tensors, any head size, the half-split or
interleaved rotation of the first ``rot_dim`` channels, angles per position or (a packed sequence) per token.
:func:`fused_qkv_rope_supported` says when it applies; elsewhere attention splits and rotates with the plain
expressions, which give the same values.

Arithmetic is in fp32 with one rounding of each output, as Inductor's fused rotation rounds. The kernels are
``torch.library.triton_op`` operators: a compiled graph calls them directly, eager code through the dispatcher.
Triton is imported on first use (:mod:`megatron_core.jit`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, next_power_of_two, triton_modules, triton_op

__all__ = ["fused_qkv_rope_supported", "split_qkv_with_rope"]

def fused_qkv_rope_supported(mixed_qkv: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether :func:`split_qkv_with_rope` serves ``mixed_qkv`` rotated by the table ``cos`` ``[s, 1, 1, rot_dim]``.

    The angles the table comes from (same shape, same device) answer the same, before the table is made.

    CUDA, a floating dtype, an even ``rot_dim``, a torch with ``triton_op`` and Triton installed.
    """
    return (mixed_qkv.is_cuda and cos.is_cuda and mixed_qkv.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and cos.shape[-1] % 2 == 0 and _FORWARD_OP is not None and have_triton())


def split_qkv_with_rope(
    mixed_qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_query_groups: int, heads_per_group: int,
    rotary_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query ``[s, b, groups * heads_per_group, d]``, key and value ``[s, b, groups, d]`` from ``mixed_qkv``.

    ``mixed_qkv`` is ``linear_qkv``'s output ``[s, b, groups * (heads_per_group + 2) * d]``; ``cos`` and ``sin``
    are ``[s, 1, 1, rot_dim]`` (row ``i`` rotates position ``i`` of the sequence: a packed sequence passes each
    token's own angles). The first ``rot_dim`` channels of the query and key come out rotated, ``x * cos +
    rotate_half(x) * sin`` (adjacent pairs with ``rotary_interleaved``), the rest and the value unchanged; all
    three are new contiguous tensors.
    """
    s = mixed_qkv.shape[0]
    heads = num_query_groups * (heads_per_group + 2)
    head_dim = mixed_qkv.shape[-1] // heads if mixed_qkv.dim() == 3 else 0
    rot_dim = cos.shape[-1]
    if mixed_qkv.dim() != 3 or head_dim * heads != mixed_qkv.shape[2] or not 0 < rot_dim <= head_dim:
        raise ValueError(
            f"split_qkv_with_rope: mixed_qkv has shape {tuple(mixed_qkv.shape)}; expected [s, b, groups "
            f"{num_query_groups} x (heads_per_group {heads_per_group} + 2) x head_dim] with head_dim >= the "
            f"rotary dim {rot_dim}"
        )
    if cos.shape[0] < s or sin.shape != cos.shape or rot_dim % 2:
        raise ValueError(
            f"split_qkv_with_rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be equal, cover the "
            f"sequence of {s} positions and rotate an even number of channels"
        )
    if _FORWARD_OP is None:
        raise RuntimeError("split_qkv_with_rope needs Triton and a torch with torch.library.triton_op "
                           "(fused_qkv_rope_supported says when it runs)")
    cos, sin = cos.reshape(cos.shape[0], rot_dim).contiguous(), sin.reshape(sin.shape[0], rot_dim).contiguous()
    return _FORWARD_OP(mixed_qkv.contiguous(), cos, sin, num_query_groups, heads_per_group, rotary_interleaved)


def _warps(heads_block: int, head_block: int) -> int:
    """Warps per program: one group's heads are ``heads_block x head_block`` elements."""
    elements = heads_block * head_block
    return 2 if elements <= 1024 else 4 if elements <= 4096 else 8


@functools.cache
def _kernels() -> tuple[Any, Any]:
    triton, tl = triton_modules()
    # Triton resolves a kernel's helper functions among its module's globals (a closure is not seen).
    global _rotation_pairs

    @triton.jit
    def _rotation_pairs(BLOCK_D: tl.constexpr, ROT: tl.constexpr, INTERLEAVED: tl.constexpr):
        # Each channel's rotation partner and the sign rotate_half gives it; channels from ROT on stay as they are.
        d = tl.arange(0, BLOCK_D)[None, :]
        if INTERLEAVED:  # pairs (2i, 2i + 1): rotate_half(x)[2i] = -x[2i + 1], rotate_half(x)[2i + 1] = x[2i]
            partner = d ^ 1
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        else:  # halves: rotate_half(x)[i] = -x[i + ROT / 2], rotate_half(x)[i + ROT / 2] = x[i]
            partner = tl.where(d < ROT // 2, d + ROT // 2, d - ROT // 2)
            sign = tl.where(d < ROT // 2, -1.0, 1.0)
        rotated = d < ROT
        return d, tl.where(rotated, partner, d), sign, rotated

    @triton.jit
    def qkv_rope_forward_kernel(
        qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, batch, groups, stride_table,
        PG: tl.constexpr, HN: tl.constexpr, ROT: tl.constexpr, HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
        INTERLEAVED: tl.constexpr,
    ):
        # One program per (token, query group): its PG query heads, its key head and its value head.
        pid = tl.program_id(0).to(tl.int64)
        group = pid % groups
        token = pid // groups  # position * batch + batch index
        position = token // batch
        j = tl.arange(0, HEADS)[:, None]  # head within the group: PG queries, then the key, then the value
        d, partner, sign, rotated = _rotation_pairs(BLOCK_D, ROT, INTERLEAVED)
        live = (j < PG + 2) & (d < HN)
        source = qkv_ptr + pid * ((PG + 2) * HN) + j * HN
        x = tl.load(source + d, mask=live, other=0.0).to(tl.float32)
        x_partner = tl.load(source + partner, mask=live, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + position * stride_table + d, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + position * stride_table + d, mask=rotated, other=0.0).to(tl.float32)
        out = tl.where(j <= PG, x * cos + sign * x_partner * sin, x).to(q_ptr.dtype.element_ty)
        in_head = d < HN
        tl.store(q_ptr + ((token * groups + group) * PG + j) * HN + d, out, mask=(j < PG) & in_head)
        tl.store(k_ptr + (token * groups + group) * HN + d + j * 0, out, mask=(j == PG) & in_head)
        tl.store(v_ptr + (token * groups + group) * HN + d + j * 0, out, mask=(j == PG + 1) & in_head)

    @triton.jit
    def qkv_rope_backward_kernel(
        dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, dqkv_ptr, batch, groups, stride_table,
        dq_s, dq_b, dq_h, dk_s, dk_b, dk_h, dv_s, dv_b, dv_h,
        PG: tl.constexpr, HN: tl.constexpr, ROT: tl.constexpr, HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
        INTERLEAVED: tl.constexpr,
    ):
        # The adjoint of the rotation: grad[e] = g[e] cos[e] - sign[e] g[p(e)] sin[p(e)] (p pairs the channels,
        # and the pair's two signs are opposite).
        pid = tl.program_id(0).to(tl.int64)
        group = pid % groups
        token = pid // groups
        position = token // batch
        b = token % batch
        j = tl.arange(0, HEADS)[:, None]
        d, partner, sign, rotated = _rotation_pairs(BLOCK_D, ROT, INTERLEAVED)
        in_head = d < HN
        is_q, is_k, is_v = (j < PG) & in_head, (j == PG) & in_head, (j == PG + 1) & in_head
        q_row = dq_ptr + position * dq_s + b * dq_b + (group * PG + j) * dq_h
        k_row = dk_ptr + position * dk_s + b * dk_b + group * dk_h + j * 0
        v_row = dv_ptr + position * dv_s + b * dv_b + group * dv_h + j * 0
        g = (tl.load(q_row + d, mask=is_q, other=0.0).to(tl.float32)
             + tl.load(k_row + d, mask=is_k, other=0.0).to(tl.float32)
             + tl.load(v_row + d, mask=is_v, other=0.0).to(tl.float32))
        g_partner = (tl.load(q_row + partner, mask=is_q, other=0.0).to(tl.float32)
                     + tl.load(k_row + partner, mask=is_k, other=0.0).to(tl.float32))
        cos = tl.load(cos_ptr + position * stride_table + d, mask=rotated, other=1.0).to(tl.float32)
        sin_partner = tl.load(sin_ptr + position * stride_table + partner, mask=rotated, other=0.0).to(tl.float32)
        out = tl.where(j <= PG, g * cos - sign * g_partner * sin_partner, g).to(dqkv_ptr.dtype.element_ty)
        tl.store(dqkv_ptr + pid * ((PG + 2) * HN) + j * HN + d, out, mask=(j < PG + 2) & in_head)

    return qkv_rope_forward_kernel, qkv_rope_backward_kernel


def _heads_block(heads_per_group: int) -> int:
    return next_power_of_two(heads_per_group + 2)


def _forward(
    mixed_qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int, heads_per_group: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s, b = mixed_qkv.shape[0], mixed_qkv.shape[1]
    head_dim = mixed_qkv.shape[2] // (groups * (heads_per_group + 2))
    q = mixed_qkv.new_empty(s, b, groups * heads_per_group, head_dim)
    k = mixed_qkv.new_empty(s, b, groups, head_dim)
    v = mixed_qkv.new_empty(s, b, groups, head_dim)
    if q.numel():
        heads, block_d = _heads_block(heads_per_group), next_power_of_two(head_dim)
        torch.library.wrap_triton(_kernels()[0])[(s * b * groups,)](
            mixed_qkv, cos, sin, q, k, v, b, groups, cos.stride(0), PG=heads_per_group, HN=head_dim,
            ROT=cos.shape[-1], HEADS=heads, BLOCK_D=block_d, INTERLEAVED=interleaved,
            num_warps=_warps(heads, block_d),
        )
    return q, k, v


def _backward(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    groups: int, heads_per_group: int, interleaved: bool,
) -> torch.Tensor:
    s, b, _, head_dim = dq.shape
    dqkv = dq.new_empty(s, b, groups * (heads_per_group + 2) * head_dim)
    if dqkv.numel():
        heads, block_d = _heads_block(heads_per_group), next_power_of_two(head_dim)
        torch.library.wrap_triton(_kernels()[1])[(s * b * groups,)](
            dq, dk, dv, cos, sin, dqkv, b, groups, cos.stride(0),
            dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2), PG=heads_per_group, HN=head_dim, ROT=cos.shape[-1],
            HEADS=heads, BLOCK_D=block_d, INTERLEAVED=interleaved, num_warps=_warps(heads, block_d),
        )
    return dqkv


def _last_dim_contiguous(t: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    if t is None:  # an output that took no part in the loss
        return like.new_zeros(shape)
    return t if t.stride(-1) == 1 else t.contiguous()


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    _, cos, sin, groups, heads_per_group, interleaved = inputs
    ctx.save_for_backward(cos, sin)
    ctx.groups, ctx.heads_per_group, ctx.interleaved = groups, heads_per_group, interleaved
    ctx.q_shape, ctx.kv_shape = tuple(output[0].shape), tuple(output[1].shape)


def _grad(ctx: Any, dq: torch.Tensor | None, dk: torch.Tensor | None, dv: torch.Tensor | None) -> tuple:
    cos, sin = ctx.saved_tensors
    like = next(t for t in (dq, dk, dv) if t is not None)
    dqkv = _BACKWARD_OP(
        _last_dim_contiguous(dq, ctx.q_shape, like), _last_dim_contiguous(dk, ctx.kv_shape, like),
        _last_dim_contiguous(dv, ctx.kv_shape, like), cos, sin, ctx.groups, ctx.heads_per_group, ctx.interleaved,
    )
    return dqkv, None, None, None, None, None


# The operators are registered at import where Triton is installed (the kernels are built on first launch).
_FORWARD_OP = triton_op("megatron_core::qkv_rope_forward", _forward)
_BACKWARD_OP = triton_op("megatron_core::qkv_rope_backward", _backward)
if _FORWARD_OP is not None:
    _FORWARD_OP.register_autograd(_grad, setup_context=_setup_context)
