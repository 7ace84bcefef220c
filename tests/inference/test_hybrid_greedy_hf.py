"""A NemotronH-shaped HybridModel ("M*M-", squared-ReLU MLP, no RoPE) imported from Hugging Face
``NemotronHForCausalLM`` (torch path, fp32 CPU) through the HF bridge: the dynamic engine's greedy tokens equal
``generate`` of the HF model (which runs its own Mamba cache and single-token update) and the plain loop."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

NEW = 6


def test_engine_greedy_equals_hf_nemotron_h_generate(tmp_path):
    from megatron_core.models.hf import AutoBridge
    from tests.inference.hybrid_fixture import greedy_params, hybrid_engine, plain_greedy, prompts
    from tests.models.hybrid.test_hf_nemotron_h_parity import PATTERN, _hf_model

    torch.manual_seed(0)
    hf = _hf_model(4)
    with torch.no_grad():  # random (not initial) values for every parameter, as the parity test
        for param in hf.parameters():
            param.normal_(0.0, 0.3)
        for i, symbol in enumerate(PATTERN):
            if symbol == "M":
                hf.model.layers[i].mixer.A_log.uniform_(-1.0, 1.0)
    hf.save_pretrained(tmp_path)
    (model,) = AutoBridge.from_hf_pretrained(tmp_path).to_megatron_model()
    model.eval()
    batch = prompts([3, 9, 5, 12], seed=3)
    expected = []
    with torch.no_grad():
        for prompt in batch:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
            expected.append(out[0, len(prompt):].tolist())
    assert [plain_greedy(model, p, NEW) for p in batch] == expected
    engine = hybrid_engine(model, max_requests=2, max_tokens=8, enable_chunked_prefill=True)
    assert [r.merge().generated_tokens for r in engine.generate(batch, greedy_params(NEW))] == expected
