"""A tiny ``pretrain_gpt.py`` checkpoint, made once per session, for the ``megatron-serve`` tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.inference.server_adversarial._support import REPO, cli_env

# One layer, 2048 positions (rope): long generations last long enough to be in flight while a test acts.
TRAIN = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--ffn-hidden-size", "32",
         "--seq-length", "16", "--max-position-embeddings", "2048", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--mock-data", "--vocab-size", "60", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--log-interval", "1",
         "--eval-interval", "0", "--eval-iters", "0", "--no-progress", "--seed", "3"]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The checkpoint directory."""
    ckpt = tmp_path_factory.mktemp("serve_ckpt") / "ckpt"
    proc = subprocess.run([sys.executable, "examples/pretrain_gpt.py", *TRAIN, "--save", str(ckpt)], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return ckpt
