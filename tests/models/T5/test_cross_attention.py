"""``CrossAttention`` against a plain computation: softmax(Q K^T / sqrt(d)) V under the context mask."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_core import tensor_parallel
from megatron_core.transformer.attention import CrossAttention, CrossAttentionSubmodules
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnMaskType
from tests.models.T5 import t5_test_utils as t5

SQ, SK, B = 5, 7, 3


def _cross_attention(**overrides) -> CrossAttention:
    submodules = CrossAttentionSubmodules(
        linear_q=tensor_parallel.ColumnParallelLinear, linear_kv=tensor_parallel.ColumnParallelLinear,
        core_attention=DotProductAttention, linear_proj=tensor_parallel.RowParallelLinear)
    return CrossAttention(t5.config(add_bias_linear=True, **overrides), submodules, layer_number=1,
                          attn_mask_type=AttnMaskType.arbitrary)


def _reference(module: CrossAttention, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention written out: per-head q from x, (k, v) rows interleaved per head in linear_kv."""
    heads, hn = t5.HEADS, t5.HIDDEN // t5.HEADS
    q = x @ module.linear_q.weight.T + module.linear_q.bias  # [sq, b, heads * hn]
    kv = context @ module.linear_kv.weight.T + module.linear_kv.bias  # [sk, b, heads * 2 * hn]
    q = q.reshape(SQ, B, heads, hn).permute(1, 2, 0, 3)  # [b, heads, sq, hn]
    kv = kv.reshape(SK, B, heads, 2 * hn).permute(1, 2, 0, 3)
    k, v = kv[..., :hn], kv[..., hn:]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hn)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    heads_out = (probs @ v).permute(2, 0, 1, 3).reshape(SQ, B, heads * hn)
    return heads_out @ module.linear_proj.weight.T, module.linear_proj.bias


def test_cross_attention_matches_plain_attention():
    module = _cross_attention()
    t5.randomize(module, seed=0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SQ, B, t5.HIDDEN, generator=gen, requires_grad=True)
    context = torch.randn(SK, B, t5.HIDDEN, generator=gen, requires_grad=True)
    lengths = torch.tensor([SK, SK - 2, 3])
    mask = (torch.arange(SK)[None, :] >= lengths[:, None])[:, None, None, :].expand(B, 1, SQ, SK)
    out, bias = module(x, attention_mask=mask, key_value_states=context)
    want_out, want_bias = _reference(module, x, context, mask)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias, want_bias, rtol=0, atol=0)
    # The gradient flows to both the queries' input and the context, as in the reference.
    weights = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad((out * weights).sum(), (x, context))
    want = torch.autograd.grad((want_out * weights).sum(), (x, context))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # Masked context positions do not influence the output.
    assert got[1][SK - 2:, 1].abs().max() == 0 and got[1][3:, 2].abs().max() == 0


def test_cross_attention_refuses_grouped_query_attention():
    with pytest.raises(ValueError, match=r"num_query_groups \(2\) must equal num_attention_heads \(4\)"):
        _cross_attention(num_query_groups=2)


def test_cross_attention_names_bad_shapes():
    module = _cross_attention()
    x, context = torch.randn(SQ, B, t5.HIDDEN), torch.randn(SK, B, t5.HIDDEN)
    with pytest.raises(ValueError, match=r"key_value_states has shape \(7, 2, 64\)"):
        module(x, None, key_value_states=torch.randn(SK, 2, t5.HIDDEN))
    with pytest.raises(ValueError, match=r"shape \(3, 1, 5, 5\); expected .*\[3, 1, 5, 7\]"):
        module(x, torch.zeros(B, 1, SQ, SQ, dtype=torch.bool), key_value_states=context)
    with pytest.raises(ValueError, match="needs key_value_states"):
        module(x, None)
