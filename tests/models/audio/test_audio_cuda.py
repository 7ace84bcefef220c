"""The audio stack on a CUDA GPU: features and the SDPA encoder agree with the CPU (TF32 off), and the optional
Transformer Engine (packed ``thd``) and flash-attention backends agree with SDPA on the same weights in bf16."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_core.models.audio import (
    NemoAudioFeatureConfig,
    NemoTransformerAudioConfig,
    NemoTransformerAudioModel,
)
from megatron_core.models.audio.nemo_audio_preprocessing import AudioToMelSpectrogramPreprocessor

pytestmark = pytest.mark.gpu

CFG = dict(n_mels=16, d_model=64, n_heads=4, n_layers=2, drop_rate=0.0, pre_encode="conv")


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _model(attn_impl: str, **overrides) -> NemoTransformerAudioModel:
    torch.manual_seed(0)
    return NemoTransformerAudioModel(NemoTransformerAudioConfig(**{**CFG, **overrides}, attn_impl=attn_impl)).eval()


def _features(lengths=(40, 29)) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    return torch.randn(len(lengths), max(lengths), CFG["n_mels"]), mask


def test_features_and_sdpa_encoder_match_cpu():
    preprocessor = AudioToMelSpectrogramPreprocessor(**NemoAudioFeatureConfig(features=16, dither=0.0).to_nemo_kwargs())
    waveform, lengths = torch.randn(2, 8000), torch.tensor([8000, 5000])
    want, want_frames = preprocessor.eval()(waveform, lengths)
    got, got_frames = preprocessor.cuda()(waveform.cuda(), lengths.cuda())
    assert torch.equal(got_frames.cpu(), want_frames)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    model = _model("sdpa", causal_mask=True, left_context=3)
    features, mask = _features()
    with torch.no_grad():
        want, want_mask = model(features, mask)
        got, got_mask = model.cuda()(features.cuda(), mask.cuda())
    assert torch.equal(got_mask.cpu(), want_mask)
    torch.testing.assert_close(got.cpu()[want_mask], want[want_mask], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine")
@pytest.mark.parametrize("causal", [False, True])
def test_transformer_engine_backend_matches_sdpa(causal: bool):
    sdpa = _model("sdpa", causal_mask=causal).cuda().to(torch.bfloat16)
    te = _model("te", causal_mask=causal).cuda().to(torch.bfloat16)
    missing, unexpected = te.load_state_dict(sdpa.state_dict(), strict=False)
    assert not [k for k in missing + unexpected if "_extra_state" not in k]
    features, mask = _features()
    features, mask = features.cuda(), mask.cuda()
    with torch.no_grad():
        want, want_mask = sdpa(features, mask)
        got, got_mask = te(features, mask)
        packed = te.forward_packed(features, mask)
    assert torch.equal(got_mask, want_mask)
    torch.testing.assert_close(got[want_mask].float(), want[want_mask].float(), rtol=3e-2, atol=3e-2)
    assert torch.all(got[~got_mask] == 0)
    torch.testing.assert_close(packed.embeddings, got[got_mask], rtol=0, atol=0)
    with torch.no_grad():  # a batch without audio skips the blocks
        empty = te.forward_packed(features, torch.zeros_like(mask))
    assert empty.embeddings.shape == (0, CFG["d_model"])


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn")
def test_flash_attention_backend_matches_sdpa():
    sdpa = _model("sdpa").cuda().to(torch.bfloat16)
    fa = _model("fa").cuda().to(torch.bfloat16)
    fa.load_state_dict(sdpa.state_dict())
    features, _ = _features(lengths=(40, 40))  # flash_attn_func has no padding mask
    with torch.no_grad():
        want, _ = sdpa(features.cuda())
        got, _ = fa(features.cuda())
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
