"""Checkpoints interoperate with NVIDIA megatron-core's ``torch_dist`` checkpoints.

tests/data/mcore_reference/ holds small GPT checkpoints written by megatron-core 0.16.1 (TP=1 and
TP=2; a GPT-2-like and a Llama-like model with SwiGLU and GQA) and the logits each gave on a fixed
input (tools/make_mcore_reference_checkpoints.py). Ours loads each of them, strictly, into our
GPTModel at TP=1 and TP=2 and reproduces the logits, and at PP=2 gets the same weights; a checkpoint
ours writes has the same keys, global shapes and shards as megatron-core's. The reverse direction
(megatron-core loads ours, same logits) runs live when megatron-core is installed (``test-oracle``
extra, also in ``dev``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_core import dist_checkpointing, parallel_state
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "mcore_reference"
TOOL = ROOT / "tools" / "make_mcore_reference_checkpoints.py"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
NAMES = sorted(MANIFEST["checkpoints"])


def _model(name: str) -> GPTModel:
    """Our GPTModel for a manifest entry (parallel sizes from parallel_state)."""
    variant = MANIFEST["variants"][MANIFEST["checkpoints"][name]["variant"]]
    config = dict(variant["config"])
    config["activation_func"] = getattr(torch.nn.functional, config.pop("activation"))
    torch.manual_seed(0)  # any initial weights: the checkpoint overwrites them
    return GPTModel(
        TransformerConfig(**config), get_gpt_layer_local_spec(), MANIFEST["vocab_size"],
        MANIFEST["max_sequence_length"], **variant["model"],
    ).eval()


def _input() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = MANIFEST["input"]
    batch, seq = spec["batch"], spec["sequence_length"]
    tokens = torch.randint(0, MANIFEST["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(spec["token_seed"]))
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    return tokens, positions, mask


def _load(model: GPTModel, directory: Path) -> None:
    state = dist_checkpointing.load(model.sharded_state_dict(), str(directory))
    model.load_state_dict(state, strict=True)


def _full_logits(model: GPTModel) -> torch.Tensor:
    with torch.no_grad():
        local = model(*_input())
    group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return local
    pieces = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def _expected_logits(name: str) -> torch.Tensor:
    return torch.load(DATA / MANIFEST["checkpoints"][name]["logits"], weights_only=True)


def test_reference_checkpoints_are_small_and_from_megatron_core():
    total = sum(path.stat().st_size for path in DATA.rglob("*") if path.is_file())
    assert total < 600_000, f"{total} bytes of reference checkpoints"
    assert MANIFEST["writer"].startswith("megatron-core ")
    for name in NAMES:
        assert json.loads((DATA / name / "metadata.json").read_text())["sharded_backend"] == "torch_dist"


@pytest.mark.parametrize("name", NAMES)
def test_megatron_core_checkpoint_loads_at_tp1_with_same_logits(name):
    model = _model(name)
    _load(model, DATA / name)
    torch.testing.assert_close(_full_logits(model), _expected_logits(name), rtol=0, atol=1e-5)


def _load_resharded(names: list[str]) -> dict:
    """TP=2 logits, and PP=2 weights against the TP=1 load, for each checkpoint."""
    results = {}
    for name in names:
        reference = _model(name)  # TP=1 (parallel_state not initialised)
        _load(reference, DATA / name)
        reference_state = reference.state_dict()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            model = _model(name)
            _load(model, DATA / name)
            error = (_full_logits(model) - _expected_logits(name)).abs().max().item()
        finally:
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
        try:
            stage = _model(name)
            _load(stage, DATA / name)
            offset = parallel_state.get_pipeline_model_parallel_rank() * len(stage.decoder.layers)
            mismatched = []
            for key, value in stage.state_dict().items():
                if not isinstance(value, torch.Tensor) or key.endswith("_extra_state"):
                    continue
                parts = key.split(".")
                if key.startswith("decoder.layers."):
                    parts[2] = str(int(parts[2]) + offset)
                if not torch.equal(value, reference_state[".".join(parts)]):
                    mismatched.append(key)
        finally:
            parallel_state.destroy_model_parallel()
        results[name] = {"tp2_logits_error": error, "pp2_mismatched": mismatched}
    return results


def test_megatron_core_checkpoint_reshards_to_tp2_and_pp2():
    for results in run_on_ranks(2, _load_resharded, NAMES):
        for name, result in results.items():
            assert result["tp2_logits_error"] < 1e-5, (name, result)
            assert result["pp2_mismatched"] == [], (name, result)


def _save_ours(directory: str, names: list[str], common_strategy: str | None = "torch") -> None:
    """Save our models, at the TP size of each reference, with megatron-core's weights and logits.

    ``common_strategy="torch"`` writes the ``common.pt`` layout megatron-core 0.16 reads; ``None``
    writes 0.19's (common state inside the DCP files).
    """
    manifest = {**MANIFEST, "writer": "megatron_core", "checkpoints": {}}
    for name in names:
        tp = MANIFEST["checkpoints"][name]["tp"]
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            model = _model(name)
            _load(model, DATA / name)
            # a different set of weights than the reference, so the reverse check is not vacuous
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.mul_(0.5)
            logits = _full_logits(model)
            dist_checkpointing.save(model.sharded_state_dict(), os.path.join(directory, name),
                                    common_strategy=common_strategy)
            if torch.distributed.get_rank() == 0:
                torch.save(logits, os.path.join(directory, MANIFEST["checkpoints"][name]["logits"]))
                manifest["checkpoints"][name] = MANIFEST["checkpoints"][name]
        finally:
            parallel_state.destroy_model_parallel()
    if torch.distributed.get_rank() == 0:
        Path(directory, "manifest.json").write_text(json.dumps(manifest, indent=2))
    torch.distributed.barrier()


def _shards(directory: Path) -> dict:
    """Key -> (global shape, sorted chunks) for tensors, key -> "bytes" for other items."""
    metadata = FileSystemReader(str(directory)).read_metadata()
    shards = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            chunks = sorted((tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in item.chunks)
            shards[key] = (tuple(item.size), str(item.properties.dtype), chunks)
        else:
            shards[key] = "bytes"
    return shards


def test_our_checkpoint_metadata_matches_megatron_core(tmp_path):
    tp2 = [name for name in NAMES if MANIFEST["checkpoints"][name]["tp"] == 2]
    run_on_ranks(2, _save_ours, str(tmp_path), tp2)
    for name in tp2:
        ours, theirs = _shards(tmp_path / name), _shards(DATA / name)
        assert sorted(ours) == sorted(theirs), (name, sorted(set(ours) ^ set(theirs)))
        assert ours == theirs, name
        assert json.loads((tmp_path / name / "metadata.json").read_text()) == json.loads(
            (DATA / name / "metadata.json").read_text()
        )


@pytest.mark.slow
def test_megatron_core_loads_our_checkpoints(tmp_path):
    """Reverse direction with megatron-core live (test-oracle extra); runs on CPU or GPU.

    Ours saves every reference model at its TP size (weights halved, so the check is not vacuous);
    the tool loads each into megatron-core's GPTModel and compares the logits (1e-5).
    """
    pytest.importorskip("megatron.core")
    run_on_ranks(2, _save_ours, str(tmp_path), NAMES)
    result = subprocess.run(
        [sys.executable, str(TOOL), "--verify", str(tmp_path)], capture_output=True, text=True, timeout=900,
        cwd=str(ROOT),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("max |logit diff|") == len(NAMES), result.stdout
