"""Issue #46, reproduction 5: inference rebuilds exactly the model a checkpoint was trained as.

``pretrain_gpt.py --hf-model`` fine-tunes a Mistral with a sliding window shorter than the prompt and a
Llama with llama3 RoPE scaling. The checkpoint records the whole model configuration as JSON
(``model_config``); the loader of ``megatron-generate`` / ``megatron-serve`` rebuilds from it, and the
logits equal the in-process HF bridge model's (and transformers'). Without the record (an older
checkpoint) the loader warns and rebuilds from the flags, which loses the window and the scaling.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.models.hf.hf_models import batch, eval_logits, hf_logits, make_hf_model, megatron_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core import parallel_state  # noqa: E402
from megatron_core.inference.cli import checkpoint as loader  # noqa: E402
from megatron_core.models.hf import AutoBridge  # noqa: E402
from megatron_core.training.model_config import MODEL_CONFIG_KEY  # noqa: E402
from tests.reliability.tools_adversarial.conftest import EXAMPLES  # noqa: E402


def _tear_down() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _train(hf_dir: Path, save: Path) -> None:
    """One zero-learning-rate step of ``pretrain_gpt.py --hf-model`` in this process, saved to ``save``."""
    if dist.is_initialized():
        pytest.skip("a process group from another test is still up")
    sys.path.insert(0, EXAMPLES)
    try:
        import pretrain_gpt
    finally:
        sys.path.remove(EXAMPLES)
    status = pretrain_gpt.main([
        "--hf-model", str(hf_dir), "--mock-data", "--seq-length", "16", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--train-iters", "1", "--eval-iters", "0", "--lr", "0", "--min-lr", "0",
        "--lr-decay-style", "constant", "--save", str(save), "--no-progress", "--log-interval", "1"])
    assert status == 0


def _loaded_logits(save: Path) -> torch.Tensor:
    loader.init_distributed_for_inference(1, 1)
    try:
        model, _, _ = loader.load_gpt_from_checkpoint(str(save))
        return eval_logits(model, *batch())
    finally:
        _tear_down()


@pytest.mark.parametrize("kind", ["mistral", "llama"])
def test_generate_loader_rebuilds_the_trained_model(kind: str, tmp_path: Path, monkeypatch) -> None:
    src, save = tmp_path / kind, tmp_path / "ckpt"
    make_hf_model(kind, src)  # mistral: sliding_window 4 < 12 tokens; llama: llama3 rope_scaling
    _train(src, save)
    in_process = eval_logits(megatron_model(AutoBridge.from_hf_pretrained(src)), *batch())
    vocab = in_process.shape[-1]

    loaded = _loaded_logits(save)[..., :vocab]
    assert (loaded - in_process).abs().max().item() < 1e-5
    torch.testing.assert_close(loaded, hf_logits(src), rtol=1e-4, atol=1e-4)

    record = json.loads(loader.read_checkpoint_common(str(save))[0][MODEL_CONFIG_KEY])
    fields = record["transformer_config"]
    if kind == "mistral":
        assert fields["window_size"] == {"tuple": [3, 0]}
    assert record["model"]["rotary"]["inv_freq"] and not record["unrecorded_fields"]

    # A checkpoint without the record (saved before it existed): a warning, and the flags lose the feature.
    original = loader.read_checkpoint_common

    def without_record(load_dir: str, **kwargs):
        common, iteration, where = original(load_dir, **kwargs)
        return {k: v for k, v in common.items() if k != MODEL_CONFIG_KEY}, iteration, where

    monkeypatch.setattr(loader, "read_checkpoint_common", without_record)
    with pytest.warns(UserWarning, match="no model_config record"):
        legacy = _loaded_logits(save)[..., :vocab]
    assert (legacy - in_process).abs().max().item() > 1e-3
