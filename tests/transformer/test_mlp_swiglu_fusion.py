"""``bias_activation_fusion`` in the MLP: the fused SwiGLU gives the plain expression's outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.models.gpt_test_utils import batch, build, llama_like


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_fused_swiglu_mlp_matches_the_plain_expression(bias):
    results = []
    for fusion in (False, True):
        torch.manual_seed(0)
        model = build(llama_like(), bias_activation_fusion=fusion, add_bias_linear=bias)
        ids, pos, labels = batch(5)
        loss = model(ids, pos, None, labels=labels).float().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain_grads), (fused_loss, fused_grads) = results
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-6, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
