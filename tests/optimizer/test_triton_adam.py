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


def _train_losses(tmp_path: Path, triton: bool, distributed_optimizer: bool) -> list[tuple[float, float]]:
    import json

    log = tmp_path / f"log_{int(triton)}_{int(distributed_optimizer)}.jsonl"
    cmd = [sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), "--model-preset", "tiny", "--num-layers", "2",
           "--hidden-size", "256", "--num-attention-heads", "4", "--ffn-hidden-size", "512", "--seq-length", "128",
           "--max-position-embeddings", "128", "--vocab-size", "1000", "--bf16", "--mock-data", "--micro-batch-size",
           "2", "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-3", "--lr-warmup-iters", "1",
           "--clip-grad", "1.0", "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--seed", "7",
           "--log-json", str(log), *(["--use-distributed-optimizer"] if distributed_optimizer else [])]
    env = {**os.environ, "MEGATRON_CORE_TRITON_ADAM": "1" if triton else "0",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [(r["lm loss"], r["grad norm"]) for r in records if r.get("kind") == "train"]


@pytest.mark.gpu
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_training_with_the_kernel_follows_torch_fused_adam(tmp_path, distributed_optimizer: bool) -> None:
    """bf16 ``pretrain_gpt.py`` (clipping on, so the fused path runs): the same losses and norms as with
    torch's fused Adam and the separate main-to-model copy, to bf16 round-off."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ours = _train_losses(tmp_path, True, distributed_optimizer)
    reference = _train_losses(tmp_path, False, distributed_optimizer)
    assert len(ours) == len(reference) == 6
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours, reference), start=1):
        assert abs(loss - ref_loss) <= 2e-3 * abs(ref_loss), (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= 2e-2 * abs(ref_norm), (step, norm, ref_norm)
