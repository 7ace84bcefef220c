"""``examples/pretrain_hybrid.py --hf-model DIR`` fine-tunes a NemotronH (HybridModel) from its Hugging Face directory.

The first step's loss equals transformers' loss on the same batch (fp32, CPU, 1e-5), a few steps run (the same
losses and gradient norms under TP=2), and the checkpoint exports back (``megatron-convert mcore-to-hf`` finds the HF directory through
the saved ``--hf-model`` flag) to files transformers loads. A missing ``--hf-model`` or a non-hybrid model is
refused with exit status 2.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.models.hf.hf_models import make_hf_model
from tests.models.hf.hybrid_models import make_hybrid_model
from tests.ports import free_port

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core.models.hf.cli import main as convert  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "examples" / "pretrain_hybrid.py"


def _flags(hf_dir: Path, *extra: str) -> list[str]:
    return ["--hf-model", str(hf_dir), "--mock-data", "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--eval-interval", "0", "--eval-iters", "1", "--lr", "0.05", "--min-lr", "0",
            "--lr-decay-style", "constant", "--make-vocab-size-divisible-by", "1", "--no-progress", "--seed", "5",
            *extra]


def _first_batch(flags: list[str]) -> dict:
    """The first training batch the script would draw with ``flags`` (built in this process, then torn down)."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import pretrain_gpt
    finally:
        sys.path.remove(str(REPO / "examples"))
    prepared: dict = {}
    try:
        pretrain_gpt._prepare(flags, prepared)
        return next(prepared["run"].train_data_iterator)
    finally:
        pretrain_gpt._tear_down()


def _hf_loss(hf_dir: Path, batch: dict) -> float:
    """transformers' mean next-token loss of ``batch`` (Megatron's labels and loss mask)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"].cpu()).logits.float()
    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].cpu().flatten(), reduction="none")
    mask = batch["loss_mask"].cpu().flatten().float()
    return float((losses * mask).sum() / mask.sum())


def _train(tmp_path: Path, flags: list[str], ranks: int = 1) -> list[dict]:
    """Run the script (under torchrun on ``ranks`` CPU ranks when more than one); return its train log records."""
    log = tmp_path / f"log{ranks}.jsonl"
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
        "--master-port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([*launcher, str(SCRIPT), *flags, "--log-interval", "1", "--log-json", str(log)],
                          cwd=tmp_path, text=True, capture_output=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "train"]


def test_first_step_loss_equals_transformers_and_steps_run(tmp_path: Path) -> None:
    src = tmp_path / "nemotron_h"
    make_hybrid_model("nemotron_h", src)
    train = _train(tmp_path, _flags(src, "--train-iters", "3", "--save", str(tmp_path / "tuned")))
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["lm loss"]) for r in train)

    batch = _first_batch(_flags(src, "--train-iters", "3"))
    expected = _hf_loss(src, batch)
    assert abs(train[0]["lm loss"] - expected) < 1e-5, (train[0]["lm loss"], expected)
    assert abs(train[2]["lm loss"] - train[0]["lm loss"]) > 1e-4  # the steps changed the model

    assert convert(["mcore-to-hf", "--mcore", str(tmp_path / "tuned"), "--out", str(tmp_path / "tuned_hf"),
                    "--no-progress"]) == 0
    assert abs(_hf_loss(tmp_path / "tuned_hf", batch) - expected) > 1e-4  # the export holds the trained weights


@pytest.mark.slow
def test_tensor_parallel_training_equals_one_process(tmp_path: Path) -> None:
    """Under TP=2 (torchrun, 2 CPU ranks) every step's loss and gradient norm equal the single-process run's."""
    src = tmp_path / "nemotron_h"
    make_hybrid_model("nemotron_h", src)
    single = _train(tmp_path, _flags(src, "--train-iters", "3"))
    parallel = _train(tmp_path, _flags(src, "--train-iters", "3", "--tensor-model-parallel-size", "2"), ranks=2)
    assert [r["iteration"] for r in parallel] == [1, 2, 3]
    for one, two in zip(single, parallel):
        assert abs(one["lm loss"] - two["lm loss"]) < 1e-5, (one, two)
        assert abs(one["grad norm"] - two["grad norm"]) < 1e-5, (one, two)


def test_refuses_a_missing_or_non_hybrid_model(tmp_path: Path, capsys) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import pretrain_hybrid
    finally:
        sys.path.remove(str(REPO / "examples"))
    assert pretrain_hybrid.main(["--mock-data", "--train-iters", "1"]) == 2
    assert "--hf-model DIR is required" in capsys.readouterr().err
    make_hf_model("llama", tmp_path / "llama")
    assert pretrain_hybrid.main(_flags(tmp_path / "llama", "--train-iters", "1")) == 2
    assert "not a hybrid Mamba model" in capsys.readouterr().err
