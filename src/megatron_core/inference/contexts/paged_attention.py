"""Decode attention that reads the paged KV cache in place (a Triton kernel, split over the KV length).

One decode token per request attends to its request's cached keys and values, which live in blocks
of ``block_size`` slots scattered through the cache (``k_cache [slots, groups, head_dim]``). Instead of
gathering every request's blocks into a dense tensor first (which copies the whole cache each step and
layer), :func:`paged_decode_attention` runs one program per (request, KV group, split): it walks its
share of the request's block table, loads keys and values straight from their slots, and keeps an
online softmax. The splits (flash-decoding) give a long sequence enough programs to fill the GPU; a
second small kernel merges their partial results by log-sum-exp. All query heads of a KV group share
one program, so the cache is read once per group (GQA without expansion).

Shapes are static for a given batch and table width, so the call is safe inside a CUDA graph.
Triton is loaded lazily (:func:`megatron_core.jit.triton_modules`); :func:`paged_decode_supported` says whether the kernel can run
(CUDA tensors, fp16/bf16, a power-of-two head dimension of 16-256, Triton installed); otherwise the
caller falls back to the gathered path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, triton_modules

__all__ = ["paged_decode_attention", "paged_decode_supported", "paged_decode_reference"]

_BLOCK_N = 64


def paged_decode_supported(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_decode_attention` can run on these tensors."""
    hn = query.shape[-1]
    return (query.is_cuda and k_cache.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and k_cache.dtype == query.dtype and 16 <= hn <= 256 and hn & (hn - 1) == 0
            and have_triton())


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()

    @triton.jit
    def paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, kv_len_ptr, out_ptr, lse_ptr, scale,
        stride_qb, stride_qh, stride_ks, stride_kg, stride_vs, stride_vg, stride_tb,
        stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
        HEADS_PER_GROUP: tl.constexpr, HPG_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS_PER_SPLIT: tl.constexpr,
    ):
        req = tl.program_id(0)
        group = tl.program_id(1)
        split = tl.program_id(2)
        kv_len = tl.load(kv_len_ptr + req)
        start = split * TOKENS_PER_SPLIT
        end = tl.minimum(start + TOKENS_PER_SPLIT, kv_len)
        heads = tl.arange(0, HPG_PAD)
        dims = tl.arange(0, HEAD_DIM)
        head_ok = heads < HEADS_PER_GROUP
        q_rows = group * HEADS_PER_GROUP + heads
        q = tl.load(q_ptr + req * stride_qb + q_rows[:, None] * stride_qh + dims[None, :],
                    mask=head_ok[:, None], other=0.0)
        m_i = tl.full([HPG_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([HPG_PAD], dtype=tl.float32)
        acc = tl.zeros([HPG_PAD, HEAD_DIM], dtype=tl.float32)
        for tok0 in range(start, end, BLOCK_N):
            toks = tok0 + tl.arange(0, BLOCK_N)
            tok_ok = toks < end
            blocks = tl.load(tables_ptr + req * stride_tb + toks // BLOCK_SIZE, mask=tok_ok, other=0)
            slots = blocks * BLOCK_SIZE + toks % BLOCK_SIZE
            k = tl.load(k_ptr + slots[:, None] * stride_ks + group * stride_kg + dims[None, :],
                        mask=tok_ok[:, None], other=0.0)
            s = (tl.dot(q, tl.trans(k)) * scale).to(tl.float32)  # fp32 also when a compiler passes scale as fp64
            s = tl.where(tok_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(v_ptr + slots[:, None] * stride_vs + group * stride_vg + dims[None, :],
                        mask=tok_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(out_ptr + req * stride_ob + q_rows[:, None] * stride_oh + split * stride_os + dims[None, :],
                 out, mask=head_ok[:, None])
        tl.store(lse_ptr + req * stride_lb + q_rows * stride_lh + split, lse, mask=head_ok)

    return paged_decode_kernel


@functools.cache
def _merge_kernel() -> Any:
    triton, tl = triton_modules()

    @triton.jit
    def merge_splits_kernel(
        partial_ptr, lse_ptr, out_ptr, num_splits, heads,
        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
        SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        req = tl.program_id(0) // heads
        head = tl.program_id(0) % heads
        splits = tl.arange(0, SPLITS_PAD)
        dims = tl.arange(0, HEAD_DIM)
        split_ok = splits < num_splits
        lse = tl.load(lse_ptr + req * stride_lb + head * stride_lh + splits, mask=split_ok, other=float("-inf"))
        weights = tl.exp(lse - tl.max(lse, 0))  # empty splits (lse -inf) weigh nothing; split 0 is never empty
        part = tl.load(partial_ptr + req * stride_pb + head * stride_ph + splits[:, None] * stride_ps + dims[None, :],
                       mask=split_ok[:, None], other=0.0)
        out = tl.sum(part * weights[:, None], 0) / tl.sum(weights, 0)
        tl.store(out_ptr + req * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))

    return merge_splits_kernel


def _num_splits(batch: int, groups: int, max_tokens: int) -> int:
    """Enough programs to fill a large GPU (about 512), but at least ``_BLOCK_N`` tokens per split."""
    want = max(1, 512 // max(1, batch * groups))
    return max(1, min(want, -(-max_tokens // _BLOCK_N)))


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_len: torch.Tensor, block_size: int,
                           scale: float | None = None) -> torch.Tensor:
    """Attention of one decode token per request over its paged cache.

    ``query [B, heads, head_dim]``; ``k_cache``/``v_cache [slots, groups, head_dim]``;
    ``block_tables [B, width]`` (block ids; entries past a request's length are never read);
    ``kv_len [B]`` (>= 1) cached tokens per request, the current token's included. Returns
    ``[B, heads, head_dim]`` in the query's dtype. Under ``torch.compile`` the kernel is an opaque
    custom op (``torch.ops.megatron_core.paged_decode_attention``), so the graph does not break here.
    """
    batch, heads, head_dim = query.shape
    groups = k_cache.shape[1]
    if heads % groups != 0:
        raise ValueError(f"paged_decode_attention: {heads} query heads are not a multiple of {groups} KV groups")
    scale = head_dim ** -0.5 if scale is None else float(scale)
    if torch.compiler.is_compiling():
        return torch.ops.megatron_core.paged_decode_attention(query, k_cache, v_cache, block_tables, kv_len,
                                                              block_size, scale)
    return _paged_decode_attention(query, k_cache, v_cache, block_tables, kv_len, block_size, scale)


@torch.library.custom_op("megatron_core::paged_decode_attention", mutates_args=())
def _paged_decode_attention_op(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, kv_len: torch.Tensor, block_size: int,
                               scale: float) -> torch.Tensor:
    return _paged_decode_attention(query, k_cache, v_cache, block_tables, kv_len, block_size, scale)


@_paged_decode_attention_op.register_fake
def _paged_decode_attention_fake(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, kv_len: torch.Tensor, block_size: int,
                                 scale: float) -> torch.Tensor:
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


def _paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, kv_len: torch.Tensor, block_size: int,
                            scale: float) -> torch.Tensor:
    batch, heads, head_dim = query.shape
    groups = k_cache.shape[1]
    heads_per_group = heads // groups
    max_tokens = block_tables.shape[1] * block_size
    splits = _num_splits(batch, groups, max_tokens)
    tokens_per_split = -(-max_tokens // splits)
    tokens_per_split = -(-tokens_per_split // _BLOCK_N) * _BLOCK_N
    splits = -(-max_tokens // tokens_per_split)
    query = query.contiguous()
    partial = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=query.device)
    hpg_pad = max(16, 1 << (heads_per_group - 1).bit_length())
    _kernel()[(batch, groups, splits)](
        query, k_cache, v_cache, block_tables, kv_len, partial, lse, scale,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), block_tables.stride(0), partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        HEADS_PER_GROUP=heads_per_group, HPG_PAD=hpg_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=_BLOCK_N, TOKENS_PER_SPLIT=tokens_per_split,
    )
    out = torch.empty_like(query)
    # One program per (request, head) merges its splits by log-sum-exp. (Left to Inductor, this reduction over a
    # short middle axis became a kernel slower than the attention itself at 64 requests.)
    _merge_kernel()[(batch * heads,)](
        partial, lse, out, splits, heads, partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        SPLITS_PAD=max(2, 1 << (splits - 1).bit_length()), HEAD_DIM=head_dim,
    )
    return out


def paged_decode_reference(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_len: torch.Tensor, block_size: int,
                           scale: float | None = None) -> torch.Tensor:
    """The same result computed by gathering each request's blocks (any device and dtype; for tests)."""
    batch, heads, head_dim = query.shape
    groups = k_cache.shape[1]
    width = block_tables.shape[1]
    k = k_cache.view(-1, block_size, groups, head_dim)[block_tables].view(batch, width * block_size, groups, head_dim)
    v = v_cache.view(-1, block_size, groups, head_dim)[block_tables].view(batch, width * block_size, groups, head_dim)
    keep = torch.arange(width * block_size, device=query.device)[None, :] < kv_len[:, None]
    q = query.view(batch, groups, heads // groups, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep[:, None, None, :], scale=scale)
    return out.reshape(batch, heads, head_dim)
