"""Mistral through the library's HF bridge: sliding window W is Megatron's ``window_size=(W - 1, 0)`` (fp32, CPU).

(The other families' parity tests are in ``tests/models/hf/``.)
"""

from __future__ import annotations

import pytest
import torch

from tests.models.hf.hf_models import SEQ, assert_same_tensors, batch, hf_logits, make_hf_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec  # noqa: E402
from megatron_core.models.hf import AutoBridge  # noqa: E402


def test_mistral_sliding_window_logits_match(tmp_path):
    """Mistral's sliding window W (a key is seen while ``q - k < W``) is Megatron's ``window_size=(W - 1, 0)``."""
    make_hf_model("mistral", tmp_path / "mistral")
    expected = hf_logits(tmp_path / "mistral")
    bridge = AutoBridge.from_hf_pretrained(tmp_path / "mistral")
    (model,) = bridge.to_megatron_model()
    model.eval()
    assert model.config.window_size == (3, 0) and SEQ > 2 * 4
    ids, pos = batch()
    with torch.no_grad():
        got = model(ids, pos, None)
        # The plain causal mask tensor, as Megatron's loops pass it, changes nothing.
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
        got_with_mask = model(ids, pos, causal)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_with_mask, expected, rtol=1e-4, atol=1e-4)
    bridge.save_hf_pretrained(model, tmp_path / "export")
    assert_same_tensors(tmp_path / "mistral", tmp_path / "export")
    # The window matters: full causal attention gives different logits.
    cfg = bridge.transformer_config(window_size=None, perform_initialization=False)
    full = GPTModel(cfg, get_gpt_layer_local_spec(), model.vocab_size, 64, position_embedding_type="rope",
                    rotary_base=5000).eval()
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(full(ids, pos, None), expected, atol=1e-3)
