"""AutoBridge on random-weight Mixtral and Qwen2-MoE models saved by transformers (fp32, CPU).

Import at TP=1 (in process), EP=2 and TP=2 (expert-TP 2) on gloo ranks gives logits within 1e-4
of transformers; every export (each expert-parallel rank writes its own experts) loads back
bitwise-identical tensors; import -> 3 training steps -> export -> transformers reproduces ours. The grouped
expert layout (``moe_grouped_gemm=True``) converts the same way.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.models.hf import dist_checks
from tests.models.hf.hf_models import MOE_FAMILIES, assert_same_tensors, batch, hf_logits, make_hf_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core.models.hf import AutoBridge  # noqa: E402


def _import_matches_and_exports_back(kind: str, tmp_path, grouped: bool):
    """Import a random HF model of ``kind`` in one process (logits checked), export it back (tensors checked);
    returns ``(HF directory, HF logits, bridge, model)``."""
    src = str(tmp_path / kind)
    make_hf_model(kind, src)
    expected = hf_logits(src)
    bridge = AutoBridge.from_hf_pretrained(src)
    config = bridge.transformer_config(perform_initialization=False, moe_grouped_gemm=True) if grouped else None
    (model,) = bridge.to_megatron_model(config=config)
    model.eval()
    ids, pos = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, None), expected, rtol=1e-4, atol=1e-4)
    bridge.save_hf_pretrained(model, tmp_path / "export")
    assert_same_tensors(src, tmp_path / "export")
    return src, expected, bridge, model


def _expert_parallel_round_trips(src: str, expected: torch.Tensor, tmp_path, grouped: bool) -> None:
    for tp, ep in ((1, 2), (2, 1)):
        out = str(tmp_path / f"tp{tp}ep{ep}")
        for logits in run_on_ranks(2, dist_checks.import_check_export, src, out, tp, 1, ep, grouped):
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert_same_tensors(src, out)


@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_moe_import_export_train_and_expert_parallel(kind: str, tmp_path) -> None:
    src, expected, bridge, model = _import_matches_and_exports_back(kind, tmp_path, grouped=False)
    ids, pos = batch()

    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        optimizer.zero_grad()
        model(ids, pos, None, labels=torch.roll(ids, -1, dims=1)).mean().backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        trained = model(ids, pos, None)
    assert (trained - expected).abs().max() > 1e-3
    bridge.save_hf_pretrained(model, tmp_path / "trained")
    torch.testing.assert_close(hf_logits(tmp_path / "trained"), trained, rtol=1e-4, atol=1e-4)

    _expert_parallel_round_trips(src, expected, tmp_path, grouped=False)


@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_grouped_experts_import_export_and_expert_parallel(kind: str, tmp_path) -> None:
    src, expected, _, model = _import_matches_and_exports_back(kind, tmp_path, grouped=True)
    experts = model.decoder.layers[0].mlp.experts
    assert type(experts).__name__ == "TEGroupedMLP" and experts.linear_fc1.weight.dim() == 3
    _expert_parallel_round_trips(src, expected, tmp_path, grouped=True)
