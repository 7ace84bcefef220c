"""``fusions.fused_softmax`` against megatron-core 0.16.1's (its PyTorch path) and against plain autograd.

Every mask type, with and without a scale, fp32 / fp16 / bf16 scores, with and without an attention sink; the
three kernel functions' values and gradients; the sink rule against ``DotProductAttention``'s.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.fusions.fused_softmax import (
    FusedScaleMaskSoftmax,
    ScaledMaskedSoftmax,
    ScaledSoftmax,
    ScaledUpperTriangMaskedSoftmax,
    SoftmaxOne,
)
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.utils import attention_mask_func


@pytest.fixture(scope="module")
def theirs():
    """megatron-core 0.16.1's module, its causal mask built on the CPU (0.16.1 builds it on "cuda")."""
    module = pytest.importorskip("megatron.core.fusions.fused_softmax")
    from megatron.core.transformer import enums, utils

    saved = module.get_default_causal_mask
    module.get_default_causal_mask = lambda sq: torch.ones(sq, sq).triu(diagonal=1).bool()
    yield module, enums.AttnMaskType, utils.attention_mask_func
    module.get_default_causal_mask = saved


_PRECISIONS = {"fp32": (torch.float32, False, False), "fp16": (torch.float16, True, False),
               "bf16": (torch.bfloat16, False, True)}


@pytest.mark.parametrize("precision", list(_PRECISIONS))
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("mask_type", ["causal", "padding", "no_mask", "arbitrary"])
def test_matches_megatron_core(theirs, mask_type, scale, precision):
    module, their_types, their_mask_func = theirs
    dtype, fp16, bf16 = _PRECISIONS[precision]
    torch.manual_seed(0)
    scores = (torch.randn(2, 3, 6, 6) * 4).to(dtype)
    mask = None if mask_type in ("causal", "no_mask") else torch.rand(2, 1, 6, 6) > 0.6
    softmax_in_fp32 = scale is not None or precision != "fp32"
    args = (fp16, bf16)
    ours = FusedScaleMaskSoftmax(*args, AttnMaskType[mask_type], True, attention_mask_func, softmax_in_fp32, scale)
    ref = module.FusedScaleMaskSoftmax(*args, their_types[mask_type], True, their_mask_func, softmax_in_fp32, scale)
    offset = torch.randn(3)
    for extra in ((), (offset,)):
        a = scores.clone().requires_grad_()
        b = scores.clone().requires_grad_()
        # (Non-leaf inputs: without upcast or scale, mask_func fills the scores in place, as in Megatron-Core.)
        out_a, out_b = ours(a * 1, mask, *extra), ref(b * 1, mask, *extra)
        assert out_a.dtype == out_b.dtype == dtype
        torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
        grad = torch.randn_like(out_a)
        out_a.backward(grad)
        out_b.backward(grad)
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_window_and_single_query(theirs):
    module, their_types, their_mask_func = theirs
    scores = torch.randn(1, 2, 7, 7)
    ours = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, False, attention_mask_func, True, None,
                                 window_size=(2, 0))
    probs = ours(scores, None)
    keep = torch.ones(7, 7, dtype=torch.bool).tril().triu(diagonal=-2)
    torch.testing.assert_close(probs, torch.softmax(scores.masked_fill(~keep, -10000.0), -1))
    # One query against a cache of keys: a causal layer builds no mask and sees every key.
    one = torch.randn(1, 2, 1, 5)
    torch.testing.assert_close(ours.forward_torch_softmax(one, None), torch.softmax(one, -1))


def test_kernel_functions_match_autograd():
    torch.manual_seed(1)
    x = torch.randn(4, 5, 5, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 5, 5, dtype=torch.float64)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    mask = torch.rand(2, 1, 5, 5) > 0.5
    cases = [
        (lambda t: ScaledUpperTriangMaskedSoftmax.apply(t, 0.7), lambda t: torch.softmax(
            (t * 0.7).masked_fill(causal, float("-inf")), -1), x),
        (lambda t: ScaledMaskedSoftmax.apply(t, mask, 0.7), lambda t: torch.softmax(
            (t * 0.7).masked_fill(mask, -10000.0), -1), x.detach().view(2, 2, 5, 5).requires_grad_()),
        (lambda t: ScaledSoftmax.apply(t, 0.7), lambda t: torch.softmax(t * 0.7, -1), x),
    ]
    for fn, reference, leaf in cases:
        mine = leaf.detach().clone().requires_grad_()
        theirs_ = leaf.detach().clone().requires_grad_()
        out = fn(mine)
        torch.testing.assert_close(out, reference(theirs_))
        out.backward(g.view_as(out))
        reference(theirs_).backward(g.view_as(out))
        torch.testing.assert_close(mine.grad, theirs_.grad)
    half = torch.randn(2, 4, 4, dtype=torch.float16)
    out = ScaledSoftmax.apply(half, 2.0)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), torch.softmax(half.float() * 2.0, -1), atol=1e-3, rtol=1e-3)


def test_fused_route_equals_torch_route():
    torch.manual_seed(2)
    scores = torch.randn(2, 2, 8, 8, dtype=torch.bfloat16)
    mask = torch.rand(2, 1, 8, 8) > 0.5
    for mask_type, m in ((AttnMaskType.causal, None), (AttnMaskType.padding, mask), (AttnMaskType.padding, None)):
        sm = FusedScaleMaskSoftmax(False, True, mask_type, True, attention_mask_func, True, 0.5)
        assert not sm.is_kernel_available(m, 2, 2, 8, 8)
        torch.testing.assert_close(sm.forward_fused_softmax(scores, m), sm.forward_torch_softmax(scores, m))


def test_softmax_one_and_the_attention_sink_of_dot_product_attention():
    x = torch.randn(2, 3, 4, 4)
    probs = SoftmaxOne(-1, torch.zeros(3))(x)  # off-by-one: + exp(0) in every denominator
    torch.testing.assert_close(probs, x.exp() / (x.exp().sum(-1, keepdim=True) + 1))
    torch.testing.assert_close(SoftmaxOne(-1, 0.5)(x), x.exp() / (x.exp().sum(-1, keepdim=True) + torch.tensor(0.5).exp()))
    # DotProductAttention's sink (SDPA with an extra channel) follows the same rule as the softmax here.
    from megatron_core.transformer.attention_kernels import attend_with_sink

    q, k, v = torch.randn(3, 1, 2, 5, 8).unbind(0)
    sink = torch.randn(2)
    sm = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, False, attention_mask_func, True, 0.25)
    expected = sm(q @ k.transpose(-1, -2), None, sink) @ v
    torch.testing.assert_close(attend_with_sink(q, k, v, sink, scale=0.25, is_causal=True), expected)


def test_batch_per_block_and_bad_input():
    # The CUDA kernel's launch arithmetic: rows of <= 128 keys pair up in a warp; a warp has at most 32 threads.
    assert [FusedScaleMaskSoftmax.get_batch_per_block(4, sk, 1, 1) for sk in (8, 17, 128, 256, 4096)] == \
        [32, 8, 8, 4, 4]
    with pytest.raises(ValueError, match="input_in_fp16 and input_in_bf16"):
        FusedScaleMaskSoftmax(True, True, AttnMaskType.causal, False, attention_mask_func, True, None)
    with pytest.raises(ValueError, match="softmax_in_fp32"):
        FusedScaleMaskSoftmax(True, False, AttnMaskType.causal, False, attention_mask_func, False, 0.5)
    sm = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, False, attention_mask_func, True, None)
    with pytest.raises(ValueError, match="sq == sk"):
        sm(torch.randn(1, 1, 4, 6), None)
    with pytest.raises(ValueError, match=r"\[b, np, sq, sk\]"):
        sm(torch.randn(4, 4), None)
    with pytest.raises(ValueError, match="heads"):
        SoftmaxOne(-1, torch.zeros(2))(torch.randn(1, 3, 2, 2))
