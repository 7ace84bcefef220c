"""Megatron-FSDP's ``fully_shard`` on one CUDA GPU (NCCL, world size 1; skipped without a GPU).

The default mesh (``device_mesh=None``: ``(fsdp, tp)`` on CUDA) at ZeRO-3 trains like plain single-GPU
AdamW (fp32, 1e-5), and a bf16 module keeps fp32 main weights and gradients while computing in bf16.
"""

from __future__ import annotations

import pytest
import torch

from tests.cuda_process_group import in_fresh_process

pytestmark = pytest.mark.gpu


def _train_on_gpu() -> dict:
    from megatron_core.distributed.fsdp.src.megatron_fsdp import fully_shard
    from tests.distributed.fsdp import fully_shard_toy as toy

    reference = toy.build(device="cuda")
    ref_opt = toy.optimizer(reference.parameters())
    module = toy.build(device="cuda")
    model, opt = fully_shard(module, toy.optimizer(module.parameters()), fsdp_unit_modules=[toy.Block])
    half = toy.build(device="cuda").to(torch.bfloat16)
    half_model, half_opt = fully_shard(half, toy.optimizer(half.parameters()), fsdp_unit_modules=[toy.Block])
    out = {"ref": [], "fsdp": [], "bf16": [], "main": {p.dtype for p in half_model.parameters()}}
    for step in range(toy.STEPS):
        x, y = (t.cuda() for t in toy.batch(step))
        for key, net, optim in (("ref", reference, ref_opt), ("fsdp", model, opt), ("bf16", half_model, half_opt)):
            optim.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
            loss.backward()
            optim.step()
            out[key].append(loss.item())
    out["grad_dtypes"] = {p.grad.dtype for p in half_opt.param_groups[0]["params"] if p.grad is not None}
    out["out_dtype"] = half_model(torch.zeros(1, toy.IN, device="cuda")).dtype
    out["weights"] = {n: (p.full_tensor() - reference.get_parameter(n)).abs().max().item()
                      for n, p in model.module.named_parameters()}
    return out


def test_fully_shard_on_one_gpu_matches_plain_training() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    result = in_fresh_process(_train_on_gpu)
    torch.testing.assert_close(torch.tensor(result["fsdp"]), torch.tensor(result["ref"]), rtol=1e-5, atol=1e-5)
    assert max(result["weights"].values()) < 1e-5, result["weights"]
    assert result["main"] == {torch.float32} and result["grad_dtypes"] == {torch.float32}
    assert result["out_dtype"] == torch.bfloat16
    torch.testing.assert_close(torch.tensor(result["bf16"]), torch.tensor(result["ref"]), rtol=3e-2, atol=3e-2)
