"""``moe_utils.RouterGatingLinearFunction``: router logits in ``moe_router_dtype`` without saving upcast copies."""

from __future__ import annotations

import pytest
import torch

from megatron_core.transformer.moe.moe_utils import RouterGatingLinearFunction, router_gating_linear


def _inputs(dtype: torch.dtype, bias: bool) -> tuple:
    gen = torch.Generator().manual_seed(0)
    inp = torch.randn(3, 5, 16, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(8, 16, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(8, generator=gen).to(dtype).requires_grad_() if bias else None
    return inp, weight, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("router_dtype", [torch.float32, torch.float64])
def test_equals_the_upcast_linear_and_saves_the_inputs_as_they_are(bias, router_dtype):
    inp, weight, b = _inputs(torch.bfloat16, bias)
    ref_inputs = [t.detach().clone().requires_grad_() if t is not None else None for t in (inp, weight, b)]
    saved: list[torch.dtype] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.dtype), t)[1], lambda t: t):
        out = router_gating_linear(inp, weight, b, router_dtype)
    assert out.dtype == router_dtype
    assert saved and all(d == torch.bfloat16 for d in saved)  # no upcast copy kept for the backward
    r_inp, r_w, r_b = ref_inputs
    ref = torch.nn.functional.linear(r_inp.to(router_dtype), r_w.to(router_dtype),
                                     r_b.to(router_dtype) if r_b is not None else None)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for got, want in ((inp, r_inp), (weight, r_w), (b, r_b)):
        if got is None:
            continue
        assert got.grad.dtype == torch.bfloat16
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


def test_no_cast_takes_the_plain_linear():
    inp, weight, b = _inputs(torch.float32, True)
    out = router_gating_linear(inp, weight, b, torch.float32)
    assert type(out.grad_fn).__name__ != "BackwardCFunction"  # not the custom function
    torch.testing.assert_close(out, torch.nn.functional.linear(inp, weight, b))


def test_gradcheck_in_double():
    inp, weight, b = (t.detach().double().requires_grad_() for t in _inputs(torch.float32, True))
    assert torch.autograd.gradcheck(lambda i, w, bb: RouterGatingLinearFunction.apply(i, w, bb, torch.float64),
                                    (inp, weight, b))
