"""MambaModel ("MMM") against Hugging Face ``Mamba2ForCausalLM`` (torch path, fp32) on the same random weights."""

from __future__ import annotations

import pytest
import torch

from tests.models.mamba.mamba_test_utils import VOCAB, batch, build

transformers = pytest.importorskip("transformers")

_MIXER = {"conv1d.weight": "conv1d_weight", "conv1d.bias": "conv1d_bias"}


def _to_megatron(name: str) -> str:
    if name == "backbone.embeddings.weight":
        return "embedding.word_embeddings.weight"
    if name == "backbone.norm_f.weight":
        return "decoder.final_norm.weight"
    if name == "lm_head.weight":
        return "output_layer.weight"
    rest = name.removeprefix("backbone.layers.")
    index, _, tail = rest.partition(".")
    if tail.startswith("mixer."):
        sub = tail.removeprefix("mixer.")
        tail = "mixer." + _MIXER.get(sub, sub)
    return f"decoder.layers.{index}.{tail}"


@pytest.mark.parametrize("chunk_size", [4, 256])
def test_logits_match_hf_mamba2(chunk_size):
    torch.manual_seed(0)
    hf_cfg = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=16, state_size=8, num_heads=4, head_dim=8, n_groups=2, expand=2,
        conv_kernel=4, num_hidden_layers=3, use_bias=False, use_conv_bias=True, tie_word_embeddings=False,
        layer_norm_epsilon=1e-5, rms_norm=True, chunk_size=chunk_size,
    )
    hf = transformers.Mamba2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # random (not initial) values for every parameter
        for param in hf.parameters():
            param.normal_(0.0, 0.3)
        for layer in hf.backbone.layers:
            layer.mixer.A_log.uniform_(-1.0, 1.0)
    model = build("MMM").eval()
    model.decoder.layers[0].mixer.chunk_size = chunk_size
    ours = dict(model.named_parameters())
    hf_params = dict(hf.named_parameters())
    assert {_to_megatron(n) for n in hf_params} == set(ours)
    with torch.no_grad():
        for name, value in hf_params.items():
            target = ours[_to_megatron(name)]
            assert target.shape == value.shape, name
            target.copy_(value)
    ids, pos, _ = batch()
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids, pos, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
