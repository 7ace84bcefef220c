"""``examples/pretrain_gpt.py`` trains the Mixtral-shaped preset under EP=2 (torchrun, 2 CPU ranks) and logs MoE metrics."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_port

pytestmark = pytest.mark.slow  # subprocess/torchrun training runs

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "pretrain_gpt.py"


COMMON = ["--mock-data", "--vocab-size", "127", "--seq-length", "32", "--max-position-embeddings", "32",
          "--micro-batch-size", "2", "--log-interval", "1", "--eval-interval", "0", "--no-progress"]


def _train_on_two_ranks(tmp_path: Path, *flags: str) -> list[dict]:
    """Run the example under torchrun on 2 CPU ranks; return its train log records."""
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(SCRIPT), *COMMON, *flags, "--log-json", str(log)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, text=True, capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "train"]


def test_mixtral_preset_trains_with_expert_parallelism(tmp_path: Path) -> None:
    train = _train_on_two_ranks(tmp_path, "--model-preset", "mixtral-tiny", "--global-batch-size", "8",
                                "--train-iters", "3", "--expert-model-parallel-size", "2",
                                "--moe-token-dispatcher-type", "alltoall", "--use-distributed-optimizer")
    assert [r["iteration"] for r in train] == [1, 2, 3]
    for record in train:
        assert math.isfinite(record["lm loss"])
        assert 0.5 < record["load_balancing_loss"] < 2.0  # ~1 when balanced (Switch normalisation)
        assert record["z_loss"] > 0 and record["load_imbalance"] >= 1.0


def test_deepseek_preset_trains_with_mtp_on_the_last_pipeline_stage(tmp_path: Path) -> None:
    # PP=2: the MTP layers and their copy of the embedding on the second stage; every rank logs each depth's loss.
    train = _train_on_two_ranks(tmp_path, "--model-preset", "deepseek-tiny", "--global-batch-size", "4",
                                "--train-iters", "2", "--num-layers", "4", "--moe-layer-freq", "[0,1,1,1]",
                                "--pipeline-model-parallel-size", "2")
    assert [r["iteration"] for r in train] == [1, 2]
    for record in train:
        assert math.isfinite(record["lm loss"])
        assert 3.0 < record["mtp_1 loss"] < 6.0, record  # about ln(127) for a fresh model
