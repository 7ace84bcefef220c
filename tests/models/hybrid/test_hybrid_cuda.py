"""A hybrid Mamba model on CUDA: fp32 equals the CPU model, bf16 stays close to it (GPU only)."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from tests.models.mamba.mamba_test_utils import VOCAB, batch, config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PATTERN = "M*M-"


def _loss_and_grads(model: torch.nn.Module, device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids, pos, labels = (t.to(device) for t in batch(seq=96))
    loss = model(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}


def test_cuda_matches_cpu_in_fp32_and_bf16_stays_close() -> None:
    torch.manual_seed(0)
    cpu_model = HybridModel(config(PATTERN), hybrid_stack_spec, VOCAB, 128, hybrid_layer_pattern=PATTERN)
    want_loss, want_grads = _loss_and_grads(cpu_model, "cpu")

    fp32 = copy.deepcopy(cpu_model).cuda()
    fp32.zero_grad(set_to_none=True)
    loss, grads = _loss_and_grads(fp32, "cuda")
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-4)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-3, atol=1e-4, msg=name)

    bf16 = copy.deepcopy(cpu_model).cuda().to(torch.bfloat16)
    bf16.zero_grad(set_to_none=True)
    loss, grads = _loss_and_grads(bf16, "cuda")
    assert abs(loss.item() - want_loss.item()) < 2e-2 * abs(want_loss.item())
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        rel = (grad - want_grads[name]).norm() / want_grads[name].norm().clamp(min=1e-12)
        assert rel < 0.1, f"{name}: relative error {rel:.3f}"
