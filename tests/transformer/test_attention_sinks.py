"""Attention sinks (``softmax_type`` 'off-by-one' / 'learnable') in ``DotProductAttention`` against a plain softmax
with one extra logit column, fp32 on CPU: causal, sliding window, GQA, padding masks and attention biases; the
sink parameter's gradients; its TP attributes and state-dict key; the paths that refuse sinks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_core.inference.contexts.base_context import BaseInferenceContext
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnMaskType

SQ, B, HEADS, HD = 7, 2, 4, 8


def _config(**overrides) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=HEADS * HD, num_attention_heads=HEADS, num_query_groups=2,
                softmax_type="learnable", attention_dropout=0.0, use_cpu_initialization=True)
    return TransformerConfig(**{**base, **overrides})


def _reference(q, k, v, sink, keep, bias=None):
    """``[sq, b, np*hn]`` from an explicit softmax over ``[scores, sink]`` (keep: ``[.., sq, sk]`` True = attend)."""
    groups = k.shape[2]
    k = k.repeat_interleave(HEADS // groups, dim=2)
    v = v.repeat_interleave(HEADS // groups, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(HD)
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~keep, float("-inf"))
    column = sink.view(1, HEADS, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(q.shape[0], q.shape[1], -1)


def _inputs(groups: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(SQ, B, HEADS, HD, generator=gen)
    k = torch.randn(SQ, B, groups, HD, generator=gen)
    v = torch.randn(SQ, B, groups, HD, generator=gen)
    return q, k, v


def _window_keep(left: int) -> torch.Tensor:
    i = torch.arange(SQ)[:, None]
    j = torch.arange(SQ)[None, :]
    return (j <= i) & (i - j <= left)


@pytest.mark.parametrize("groups", [4, 2, 1])
@pytest.mark.parametrize("window", [None, (2, 0)])
def test_learnable_sinks_match_a_softmax_with_a_sink_column(groups: int, window):
    torch.manual_seed(0)
    attention = DotProductAttention(_config(num_query_groups=groups, window_size=window), 1, AttnMaskType.causal)
    with torch.no_grad():
        attention.softmax_offset.copy_(torch.tensor([-1.0, 0.5, 2.0, 0.0]))
    q, k, v = _inputs(groups)
    q.requires_grad_(True)
    out = attention(q, k, v, None)
    keep = _window_keep(window[0]) if window else _window_keep(SQ)
    sink = attention.softmax_offset.detach().clone().requires_grad_(True)
    q_ref = q.detach().clone().requires_grad_(True)
    expected = _reference(q_ref, k, v, sink, keep)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(attention.softmax_offset.grad, sink.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.grad, q_ref.grad, rtol=1e-5, atol=1e-5)
    assert attention.softmax_offset.grad.abs().min() > 0


def test_off_by_one_adds_one_to_every_denominator_and_has_no_parameter():
    attention = DotProductAttention(_config(softmax_type="off-by-one"), 1, AttnMaskType.causal)
    assert list(attention.parameters()) == [] and "softmax_offset" not in attention.state_dict()
    q, k, v = _inputs()
    expected = _reference(q, k, v, torch.zeros(HEADS), _window_keep(SQ))
    torch.testing.assert_close(attention(q, k, v, None), expected, rtol=1e-5, atol=1e-5)


def test_sinks_with_a_padding_mask_and_an_attention_bias():
    attention = DotProductAttention(_config(), 1, AttnMaskType.padding)
    with torch.no_grad():
        attention.softmax_offset.copy_(torch.tensor([0.3, -0.7, 1.1, 0.0]))
    q, k, v = _inputs(seed=1)
    masked = torch.zeros(B, 1, SQ, SQ, dtype=torch.bool)
    masked[0, :, :, 5:] = True  # the first sequence's last two keys are padding
    masked[1, :, 3, :] = True  # a fully masked row: only the sink remains, the output is 0
    bias = torch.randn(1, HEADS, SQ, SQ)
    out = attention(q, k, v, masked, attention_bias=bias)
    expected = _reference(q, k, v, attention.softmax_offset.detach(), ~masked, bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out[3, 1].abs().max() == 0


def test_causal_mask_tensor_and_top_left_causal_with_fewer_queries():
    attention = DotProductAttention(_config(), 1, AttnMaskType.causal)
    q, k, v = _inputs(seed=2)
    plain = torch.ones(1, 1, SQ, SQ, dtype=torch.bool).triu(1)
    sink = attention.softmax_offset.detach()
    torch.testing.assert_close(attention(q, k, v, plain), _reference(q, k, v, sink, _window_keep(SQ)),
                               rtol=1e-5, atol=1e-5)
    out = attention(q[:3], k, v, None)  # 'causal' aligns top-left: query i sees keys 0..i
    keep = torch.ones(3, SQ, dtype=torch.bool).tril()
    torch.testing.assert_close(out, _reference(q[:3], k, v, sink, keep), rtol=1e-5, atol=1e-5)


def test_sink_parameter_is_split_over_heads_and_named_like_megatron():
    attention = DotProductAttention(_config(), 1, AttnMaskType.causal)
    param = attention.softmax_offset
    assert isinstance(param, torch.nn.Parameter) and param.shape == (HEADS,)
    assert param.tensor_model_parallel and param.partition_dim == 0
    sharded = attention.sharded_state_dict(prefix="decoder.layers.0.self_attention.core_attention.")
    assert list(sharded) == ["decoder.layers.0.self_attention.core_attention.softmax_offset"]
    assert DotProductAttention(_config(softmax_type="vanilla"), 1, AttnMaskType.causal).softmax_offset is None


def test_unsupported_paths_raise_naming_softmax_type():
    with pytest.raises(ValueError, match="softmax_type"):
        _config(softmax_type="sigmoid")
    attention = DotProductAttention(_config(), 1, AttnMaskType.causal)
    q, k, v = _inputs()
    cu = torch.tensor([0, 3, SQ], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4)
    with pytest.raises(ValueError, match="softmax_type='learnable'.*packed sequences"):
        attention(q[:, :1], k[:, :1], v[:, :1], None, packed_seq_params=packed)
    with pytest.raises(ValueError, match="softmax_type='off-by-one'"):
        BaseInferenceContext.check_attention_supported(SimpleNamespace(config=_config(softmax_type="off-by-one")))
    BaseInferenceContext.check_attention_supported(SimpleNamespace(config=_config(softmax_type="vanilla")))
