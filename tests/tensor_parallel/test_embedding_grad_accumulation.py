"""The embedding lookup of ``gradient_accumulation_fusion``: its weight gradient is added to ``main_grad`` directly.

Checked on CPU in fp32 against autograd's dense gradient of ``F.embedding`` (repeated ids included), on top of
a gradient already in ``main_grad``, with the deterministic and the atomic kernel, through the custom op inside a
traced graph, and on a ``main_grad`` that DDP left unzeroed for its first write.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.tensor_parallel.embedding_function import embedding_with_grad_accumulation
from megatron_core.tensor_parallel.wgrad_accumulation import expect_first_write, pending_first_writes

VOCAB, HIDDEN = 11, 5
IDS = torch.tensor([[2, 7, 2, 0], [7, 7, 10, 3]])


def _weight(main_grad: torch.Tensor) -> torch.nn.Parameter:
    weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)))
    weight.main_grad = main_grad
    weight.grad_added_to_main_grad = False
    return weight


def _reference(weight: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    ref = weight.detach().clone().requires_grad_(True)
    F.embedding(IDS, ref).backward(grad_out)
    return ref.grad


GRAD_OUT = torch.randn(*IDS.shape, HIDDEN, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("deterministic", [False, True])
def test_lookup_adds_its_weight_gradient_to_main_grad(deterministic):
    before = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(2))
    weight = _weight(before.clone())
    out = embedding_with_grad_accumulation(IDS, weight, deterministic)
    torch.testing.assert_close(out, F.embedding(IDS, weight.detach()), rtol=0, atol=0)
    out.backward(GRAD_OUT)
    torch.testing.assert_close(weight.main_grad, before + _reference(weight, GRAD_OUT), rtol=1e-6, atol=1e-6)
    assert weight.grad_added_to_main_grad and weight.grad is not None and weight.grad.shape == weight.shape


def test_tied_weight_gets_a_zero_placeholder_gradient():
    weight = _weight(torch.zeros(VOCAB, HIDDEN))
    weight.zero_out_wgrad = True  # DDP's hook adds .grad for such a weight: the placeholder must add nothing
    embedding_with_grad_accumulation(IDS, weight).backward(GRAD_OUT)
    assert torch.equal(weight.grad, torch.zeros_like(weight))
    torch.testing.assert_close(weight.main_grad, _reference(weight, GRAD_OUT), rtol=1e-6, atol=1e-6)


def test_unzeroed_main_grad_awaiting_its_first_write_is_zeroed_before_the_scatter():
    weight = _weight(torch.full((VOCAB, HIDDEN), float("nan")))
    expect_first_write([weight.main_grad])
    embedding_with_grad_accumulation(IDS, weight).backward(GRAD_OUT)
    assert not pending_first_writes()
    torch.testing.assert_close(weight.main_grad, _reference(weight, GRAD_OUT), rtol=1e-6, atol=1e-6)


def test_traced_graph_calls_the_custom_op_on_the_real_main_grad():
    torch._dynamo.reset()
    weight = _weight(torch.zeros(VOCAB, HIDDEN))
    step = torch.compile(lambda ids: embedding_with_grad_accumulation(ids, weight).mul(2.0).sum(),
                         backend="aot_eager", fullgraph=True)
    step(IDS).backward()
    torch.testing.assert_close(weight.main_grad, _reference(weight, torch.full_like(GRAD_OUT, 2.0)),
                               rtol=1e-6, atol=1e-6)
