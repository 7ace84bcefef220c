"""``NemoTransformerAudioModel``: ``forward`` / ``forward_packed`` against the hand-written encoder reference, the
config helpers, bf16 towers taking fp32 features, and ``estimate_flops`` against counts written out by hand."""

from __future__ import annotations

import pytest
import torch

from megatron_core.models.audio import (
    NemoTransformerAudioConfig,
    NemoTransformerAudioModel,
    PackedAudioEmbeddings,
)
from tests.models.audio import encoder_reference as ref

CFG = dict(n_mels=6, d_model=16, n_heads=4, n_layers=2, drop_rate=0.0, attn_impl="sdpa")


def _model(**overrides) -> NemoTransformerAudioModel:
    torch.manual_seed(0)
    return NemoTransformerAudioModel(NemoTransformerAudioConfig(**{**CFG, **overrides})).eval()


@pytest.mark.parametrize("pre_encode", ["conv", "stacking"])
def test_forward_and_packed_match_reference(pre_encode: str):
    model = _model(pre_encode=pre_encode, subsampling_factor=3)
    torch.manual_seed(1)
    features = torch.randn(2, 14, 6)
    mask = torch.arange(14)[None, :] < torch.tensor([14, 9])[:, None]
    with torch.no_grad():
        embeddings, out_mask = model(features, mask)
        packed = model.forward_packed(features, mask)
    state = {k[len("encoder."):]: v for k, v in model.state_dict().items()}
    expected, lengths = ref.encoder(state, features.transpose(1, 2), torch.tensor([14, 9]), kind=pre_encode,
                                    n_layers=2, heads=4, factor=3)
    torch.testing.assert_close(embeddings, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert out_mask.tolist() == (torch.arange(embeddings.shape[1])[None, :] < lengths[:, None]).tolist()
    assert isinstance(packed, PackedAudioEmbeddings) and packed.lengths.dtype == torch.int32
    assert packed.lengths.tolist() == lengths.tolist()
    torch.testing.assert_close(packed.embeddings, embeddings[out_mask], rtol=0, atol=0)
    assert all(key.startswith("encoder.") for key in model.state_dict())


def test_no_mask_means_all_frames_and_bf16_tower():
    model = _model()
    features = torch.randn(2, 8, 6)
    with torch.no_grad():
        full, mask = model(features)
        masked, _ = model(features, torch.ones(2, 8, dtype=torch.bool))
    assert mask.all() and mask.shape == (2, 2)
    torch.testing.assert_close(full, masked, rtol=0, atol=0)
    half = _model(pre_encode="stacking").to(torch.bfloat16)
    with torch.no_grad():
        out, _ = half(features)
    assert out.dtype == torch.bfloat16


def test_input_checks_and_config_helpers():
    model = _model()
    with pytest.raises(ValueError, match="n_mels"):
        model(torch.randn(1, 8, 5))
    with pytest.raises(ValueError, match=r"\[b, t, n_mels\]"):
        model.forward_packed(torch.randn(8, 6))
    cfg = NemoTransformerAudioConfig.from_dict({"d_model": 32, "_target_": "nemo...", "feat_in": 80})
    assert cfg.d_model == 32 and cfg.output_embedding_dim == 32 and cfg.encoder_time_stride == 4
    assert NemoTransformerAudioConfig(pre_encode="stacking", subsampling_factor=8).encoder_time_stride == 8


def test_estimate_flops_by_hand():
    d, mels, layers = 16, 6, 2
    lengths = torch.tensor([13, 6])
    model = _model()
    flops = model.estimate_flops(lengths, include_backward=False)
    t1, t2, t3 = 13, 7, 4
    pre = 2 * 2 * t1 * d * mels * 3 + 2 * 2 * (t2 + t3) * d * d * 3
    steps = [13 // 4, 6 // 4]
    per_layer = sum(24 * s * d * d + 4 * s * s * d for s in steps)
    assert flops["pre_encode_forward"].item() == pre
    assert flops["transformer_forward"].item() == layers * per_layer
    assert flops["nemo_forward"].item() == flops["nemo_train"].item() == pre + layers * per_layer
    model.train()
    assert model.estimate_flops(lengths)["nemo_train"].item() == 3 * (pre + layers * per_layer)
    windowed = _model(pre_encode="stacking", subsampling_factor=2, causal_mask=True, left_context=1)
    flops = windowed.estimate_flops([13, 6], max_input_frames=14, include_backward=False)
    assert flops["pre_encode_forward"].item() == 2 * 2 * 7 * (2 * mels) * d
    pairs = sum(sum(min(i + 1, 2) for i in range(s)) for s in (7, 3))  # each step sees itself and one before
    assert flops["transformer_forward"].item() == layers * (24 * 10 * d * d + 4 * pairs * d)
    assert model.estimate_flops([])["nemo_forward"].item() == 0.0
