"""``megatron_core.optimizer.triton_adam``: the kernel equals torch's Adam/AdamW, and the Megatron
optimizers step identically with it and without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.optimizer.triton_adam_check import check

REPO = Path(__file__).resolve().parents[2]


def test_kernel_matches_torch_adam_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "tests.optimizer.triton_adam_check"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "triton adam ok" in done.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("adamw", [False, True])
def test_kernel_matches_torch_fused_adam_on_gpu(adamw: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check("cuda", adamw)



def _float16_steps(triton: bool, monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    from megatron_core.optimizer import OptimizerConfig
    from megatron_core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from megatron_core.optimizer.triton_adam import supports_triton_adam

    monkeypatch.setenv("MEGATRON_CORE_TRITON_ADAM", "1" if triton else "0")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8)).cuda().to(torch.bfloat16)
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")  # as DDP leaves them
    inner = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, fused=True)
    opt = Float16OptimizerWithFloat16Params(inner, OptimizerConfig(lr=0.05, clip_grad=0.5, weight_decay=0.1,
                                                                   bf16=True), None)
    gen = torch.Generator().manual_seed(1)
    results = []
    for scale in (3.0, 0.01, float("inf"), 2.0):
        for p in model.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=gen) * scale)
        assert supports_triton_adam(inner) is triton
        results.append(opt.step())
    mains = [m.detach().clone() for group in opt.fp32_from_float16_groups for m in group]
    return [p.detach().clone() for p in model.parameters()], mains, results


@pytest.mark.gpu
def test_float16_optimizer_with_the_kernel_equals_torch_fused_adam(monkeypatch) -> None:
    """bf16 model, fp32 main params, clipping on and one inf step: the kernel's path (model copies written
    by the kernel) gives torch's main params and the same bf16 model params."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, mains, results = _float16_steps(True, monkeypatch)
    ref_model, ref_mains, ref_results = _float16_steps(False, monkeypatch)
    assert [r[0] for r in results] == [r[0] for r in ref_results] == [True, True, False, True]
    for got, want in zip(mains, ref_mains):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for got, want, main in zip(model, ref_model, mains):
        torch.testing.assert_close(got, main.to(torch.bfloat16), rtol=0, atol=0)  # the kernel wrote it
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
