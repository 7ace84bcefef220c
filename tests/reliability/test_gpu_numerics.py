"""Section 7, checks 6 (bf16 part) and 7 (GPU part); run on a CUDA machine (``gpu`` mark).

- bf16 parity: the tiny GPT in bf16 on the GPU (and, in CPU CI, on the CPU) against the fp32 single-process reference on identical
  weights and data: relative Frobenius error <= 2e-2 on the loss, the logits and every gradient.
- deterministic mode: two fresh processes with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``,
  ``NCCL_ALGO=Ring`` and ``torch.use_deterministic_algorithms(True)`` train 20 steps on the GPU and
  produce the same SHA-256 over their per-step losses.

Command (on the GPU machine): ``pytest -q -m gpu tests/reliability/test_gpu_numerics.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
VOCAB, SEQ, BATCH = 64, 16, 4

DETERMINISTIC_RUN = r'''
import hashlib, os, sys, tempfile
from datetime import timedelta
import torch, torch.distributed as dist
torch.use_deterministic_algorithms(True)
tmp = tempfile.mkdtemp()
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0, world_size=1,
                        timeout=timedelta(seconds=60))
from tests.reliability.test_gpu_numerics import build_pair
_, model = build_pair(torch.device("cuda"), torch.float32)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(5)
sha = hashlib.sha256()
for step in range(20):
    tokens = torch.randint(0, 64, (4, 17), generator=gen).cuda()
    loss = model(tokens[:, :-1], torch.arange(16, device="cuda").expand(4, 16), None, labels=tokens[:, 1:]).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    sha.update(loss.detach().float().cpu().numpy().tobytes())
print(sha.hexdigest())
'''


def build_pair(device: torch.device, dtype: torch.dtype):
    """``(fp32 CPU reference, model on device in dtype)`` with identical initial weights (TP=1)."""
    from megatron_core import parallel_state, tensor_parallel
    from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
    from megatron_core.transformer import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)

    def make(params_dtype: torch.dtype) -> GPTModel:
        torch.manual_seed(3)
        tensor_parallel.model_parallel_cuda_manual_seed(3)
        config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                   normalization="RMSNorm", gated_linear_unit=True,
                                   activation_func=torch.nn.functional.silu, add_bias_linear=False,
                                   hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                                   bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype)
        return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope")

    reference = make(torch.float32)
    other = make(dtype)
    other.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                           for k, v in reference.state_dict().items() if v is not None}, strict=False)
    return reference, other.to(device)


def _rel_fro(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def _parity(device: str = "cuda") -> dict[str, float]:
    reference, bf16 = build_pair(torch.device(device), torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    errors = {}
    outputs = []
    for model, where in ((reference, "cpu"), (bf16, device)):
        logits = model(tokens[:, :-1].to(where), positions.to(where), None)
        loss = model(tokens[:, :-1].to(where), positions.to(where), None, labels=tokens[:, 1:].to(where)).mean()
        loss.backward()
        outputs.append((logits, loss, dict(model.named_parameters())))
    (ref_logits, ref_loss, ref_params), (logits, loss, params) = outputs
    errors["loss"] = _rel_fro(loss, ref_loss)
    errors["logits"] = _rel_fro(logits, ref_logits)
    for name, p in ref_params.items():
        errors[f"grad {name}"] = _rel_fro(params[name].grad, p.grad)
    return errors


def _check_parity(device: str) -> None:
    from tests.dist_harness import run_on_ranks

    errors = run_on_ranks(1, _parity, device)[0]
    assert len(errors) > 10, errors
    worst = max(errors.items(), key=lambda kv: kv[1])
    assert worst[1] <= 2e-2, f"largest relative Frobenius error {worst[1]:.3e} at {worst[0]}"


@pytest.mark.gpu
def test_bf16_matches_fp32_reference_by_relative_frobenius_error() -> None:
    _check_parity("cuda")


def test_bf16_on_cpu_matches_fp32_reference_by_relative_frobenius_error() -> None:
    _check_parity("cpu")


@pytest.mark.gpu
def test_deterministic_mode_runs_are_bitwise_identical() -> None:
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    hashes = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", DETERMINISTIC_RUN], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        hashes.append(proc.stdout.strip().splitlines()[-1])
    assert hashes[0] == hashes[1], hashes
