"""``examples/pretrain_gpt.py --hf-model DIR`` fine-tunes from a Hugging Face directory, and its checkpoint exports back.

With a zero learning rate the saved model must be the imported one: ``megatron-convert
mcore-to-hf`` (which finds the HF directory through the saved ``--hf-model`` flag) gives back
bitwise-identical tensors. With a real learning rate the exported model differs and loads in
transformers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.models.hf.hf_models import hf_logits, make_hf_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core.models.hf.cli import main as convert  # noqa: E402
from tests.models.hf.hf_models import assert_same_tensors  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "examples" / "pretrain_gpt.py"


def _train(tmp_path: Path, hf_dir: Path, save: Path, lr: str, *extra: str) -> None:
    flags = [*extra, "--hf-model", str(hf_dir), "--mock-data", "--seq-length", "16", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--train-iters", "2", "--eval-interval", "0", "--eval-iters", "1",
             "--lr", lr, "--min-lr", "0", "--lr-decay-style", "constant", "--save", str(save), "--no-progress"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags], cwd=tmp_path, text=True, capture_output=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_pretrain_gpt_hf_model_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "qwen3"
    make_hf_model("qwen3", src)
    _train(tmp_path, src, tmp_path / "frozen", "0")
    assert convert(["mcore-to-hf", "--mcore", str(tmp_path / "frozen"), "--out", str(tmp_path / "back"),
                    "--no-progress"]) == 0
    assert_same_tensors(src, tmp_path / "back")

    _train(tmp_path, src, tmp_path / "tuned", "0.01")
    assert convert(["mcore-to-hf", "--mcore", str(tmp_path / "tuned"), "--out", str(tmp_path / "tuned_hf"),
                    "--no-progress"]) == 0
    assert not torch.allclose(hf_logits(tmp_path / "tuned_hf"), hf_logits(src), atol=1e-3)


def test_pretrain_gpt_hf_moe_model_with_grouped_experts_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "mixtral"
    make_hf_model("mixtral", src)
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from gpt_training.hf_model import hf_model_chunks, load_bridge
    finally:
        sys.path.remove(str(REPO / "examples"))
    base = SimpleNamespace(moe_grouped_gemm=True, use_cpu_initialization=True)
    _, (model,), _ = hf_model_chunks(load_bridge(str(src)), SimpleNamespace(make_vocab_size_divisible_by=None), base)
    assert type(model.decoder.layers[0].mlp.experts).__name__ == "TEGroupedMLP"  # the flag reaches the bridge
    _train(tmp_path, src, tmp_path / "frozen", "0", "--moe-grouped-gemm")
    assert convert(["mcore-to-hf", "--mcore", str(tmp_path / "frozen"), "--out", str(tmp_path / "back"),
                    "--no-progress"]) == 0
    assert_same_tensors(src, tmp_path / "back")
