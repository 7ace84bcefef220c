"""FSDP2 on one CUDA GPU (skipped without a GPU): ``pretrain_gpt.py --use-torch-fsdp2 --bf16`` trains like DDP.

One process (world size 1, NCCL): the FSDP2 wrapper keeps fp32 shards and computes in bf16 through its
mixed-precision policy, DDP runs a ``Float16Module`` with fp32 main params; six steps of both from the
same seed give the same losses within bf16 round-off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--ffn-hidden-size", "512",
         "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "1000", "--bf16", "--mock-data",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-3",
         "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--seed", "7",
         "--untie-embeddings-and-output-weights", "--use-cpu-initialization"]


def _losses(tmp_path: Path, extra: list[str], name: str) -> list[float]:
    log = tmp_path / f"{name}.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    done = subprocess.run([sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), *FLAGS, "--log-json", str(log),
                           *extra], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return [r["lm loss"] for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "train"]


def test_fsdp2_bf16_on_one_gpu_trains_like_ddp(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fsdp = _losses(tmp_path, ["--use-torch-fsdp2"], "fsdp")
    ddp = _losses(tmp_path, [], "ddp")
    assert len(fsdp) == len(ddp) == 6
    assert fsdp[0] == pytest.approx(ddp[0], rel=1e-2)  # the same weights and data
    for step, (a, b) in enumerate(zip(fsdp, ddp), start=1):
        assert abs(a - b) <= 2e-2 * abs(b), (step, fsdp, ddp)
    assert fsdp[-1] < fsdp[0]
