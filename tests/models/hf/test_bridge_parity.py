"""AutoBridge on random-weight Llama / Qwen2 / Qwen3 / GPT-2 models saved by transformers (fp32, CPU).

For every family: import at TP=1 (in process), TP=2 and PP=2 (gloo ranks) gives logits within
1e-4 of transformers; each export loads back bitwise-identical tensors; import -> 3 training
steps -> export -> transformers reproduces our logits. bf16 and sharded (indexed) inputs keep
their dtype on export.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.models.hf import dist_checks
from tests.models.hf.hf_models import (
    FAMILIES,
    assert_same_tensors,
    batch,
    hf_logits,
    make_hf_model,
    our_logits,
)

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core.models.hf import AutoBridge  # noqa: E402


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    """One saved model per family and its reference logits."""
    root = tmp_path_factory.mktemp("hf_models")
    out = {}
    for kind in FAMILIES:
        make_hf_model(kind, root / kind)
        out[kind] = str(root / kind)
    return out


@pytest.mark.parametrize("kind", FAMILIES)
def test_import_tp1_export_and_train(kind: str, hf_dirs: dict, tmp_path) -> None:
    src = hf_dirs[kind]
    expected = hf_logits(src)
    bridge = AutoBridge.from_hf_pretrained(src)
    (model,) = bridge.to_megatron_model()
    model.eval()
    torch.testing.assert_close(our_logits(model), expected, rtol=1e-4, atol=1e-4)

    bridge.save_hf_pretrained(model, tmp_path / "export")
    assert_same_tensors(src, tmp_path / "export")
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]

    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids, pos = batch()
    for _ in range(3):
        optimizer.zero_grad()
        model(ids, pos, None, labels=torch.roll(ids, -1, dims=1)).mean().backward()
        optimizer.step()
    model.eval()
    trained = our_logits(model)
    assert (trained - expected).abs().max() > 1e-3  # training changed the model
    bridge.save_hf_pretrained(model, tmp_path / "trained")
    torch.testing.assert_close(hf_logits(tmp_path / "trained"), trained, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", FAMILIES)
def test_import_tp2_pp2_logits_and_export(kind: str, hf_dirs: dict, tmp_path) -> None:
    src = hf_dirs[kind]
    expected = hf_logits(src)
    for tp, pp in ((2, 1), (1, 2)):
        out = str(tmp_path / f"tp{tp}pp{pp}")
        results = run_on_ranks(2, dist_checks.import_check_export, src, out, tp, pp)
        last = [r for r in results if r is not None]
        assert len(last) == (2 if tp == 2 else 1)
        for logits in last:
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert_same_tensors(src, out)


def test_train_at_tp2_then_transformers_reproduces(hf_dirs: dict, tmp_path) -> None:
    out = str(tmp_path / "trained")
    results = run_on_ranks(2, dist_checks.train_then_export, hf_dirs["llama"], out, 2)
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(hf_logits(out), results[0], rtol=1e-4, atol=1e-4)


def test_bf16_sharded_checkpoint_round_trip(tmp_path) -> None:
    src = tmp_path / "bf16"
    make_hf_model("qwen3", src, dtype=torch.bfloat16, max_shard_size="40KB")
    assert os.path.isfile(src / "model.safetensors.index.json")
    bridge = AutoBridge.from_hf_pretrained(src)
    (model,) = bridge.to_megatron_model()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    bridge.save_hf_pretrained(model, tmp_path / "out", max_shard_size="40KB")
    assert_same_tensors(src, tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
