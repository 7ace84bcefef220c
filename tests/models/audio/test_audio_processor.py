"""``NemoAudioProcessor`` and the token estimator: frame and embedding counts (also of slices), log-mel features
equal to the preprocessor's on the same waveform, multi-channel / lazily decoded / integer PCM clips, and errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from megatron_core.models.audio import (
    NemoAudioFeatureConfig,
    NemoAudioProcessor,
    NemoTransformerAudioConfig,
    NemoTransformerAudioTokenEstimator,
    ceil_div,
)
from megatron_core.models.audio.nemo_audio_preprocessing import AudioToMelSpectrogramPreprocessor

FEATURES = NemoAudioFeatureConfig(features=16)


@dataclass
class AudioRef:
    """The duck-typed audio reference of the data pipeline."""

    data: Any
    sample_rate: int | None = 16000
    num_samples: int | None = None
    slice_range: tuple[int, int] | None = None


class _Decoded:
    def __init__(self, clips):
        self.audio_clips = clips


class _Decoder:
    """An AVDecoder-like object: int16 stereo clips at 16 kHz."""

    def __init__(self, clips):
        self.clips = clips

    def get_audio(self):
        return _Decoded(self.clips)

    def get_audio_samples_per_second(self):
        return 16000


def _processor(stride: int = 4, stack: int = 2, pre_encode: str = "conv") -> NemoAudioProcessor:
    estimator = NemoTransformerAudioTokenEstimator(encoder_time_stride=stride, stack_factor=stack,
                                                   pre_encode=pre_encode)
    return NemoAudioProcessor(token_estimator=estimator, feature_config=FEATURES)


def test_token_estimator_math():
    conv = NemoTransformerAudioTokenEstimator(encoder_time_stride=4, stack_factor=2)
    assert [conv(n) for n in (0, 3, 4, 15, 16, 17)] == [0, 0, 1, 2, 2, 2]
    stacking = NemoTransformerAudioTokenEstimator(encoder_time_stride=8, pre_encode="stacking")
    assert [stacking.estimate_from_num_frames(n) for n in (0, 1, 8, 9)] == [0, 1, 1, 2]
    assert NemoTransformerAudioConfig(pre_encode="stacking", subsampling_factor=8).encoder_time_stride == 8
    with pytest.raises(ValueError, match="num_frames"):
        conv(-1)
    with pytest.raises(ValueError, match="padded_num_frames"):
        conv(5, padded_num_frames=4)
    with pytest.raises(ValueError, match="pre_encode"):
        NemoTransformerAudioTokenEstimator(encoder_time_stride=4, pre_encode="lstm")(4)
    assert ceil_div(7, 2) == 4 and ceil_div(0, 3) == 0
    with pytest.raises(ValueError, match="divisor"):
        ceil_div(1, 0)


def test_counts_and_slices():
    processor = _processor()
    assert processor.input_feature_dim == 16 and processor.sample_rate == 16000
    waveform = torch.randn(16000)
    assert processor.compute_num_frames(AudioRef(waveform)) == 100
    assert processor.compute_num_embeddings(AudioRef(waveform)) == 13  # 100 frames -> 25 steps -> 13 stacks
    assert processor.compute_num_frames(AudioRef(waveform, slice_range=(160, 1760))) == 10
    assert processor.compute_num_frames(AudioRef(None, num_samples=3200)) == 20
    assert processor.num_frames_from_num_samples(1759) - processor.num_frames_from_num_samples(160) == 9
    assert processor.num_embeddings_from_num_samples(16000) == 13
    with pytest.raises(ValueError, match="num_samples"):
        processor.num_frames_from_num_samples(-1)
    with pytest.raises(ValueError, match="sample rate 16000, got 8000"):
        processor.compute_num_frames(AudioRef(waveform, sample_rate=8000))


def test_materialize_equals_preprocessor():
    processor = _processor()
    torch.manual_seed(0)
    stereo = torch.randn(2, 4000)
    features, frames = processor.materialize(AudioRef(stereo, num_samples=4100, slice_range=(0, 3200)))
    preprocessor = AudioToMelSpectrogramPreprocessor(**FEATURES.to_nemo_kwargs()).eval()
    mono = torch.nn.functional.pad(stereo.mean(dim=0), (0, 100))[:3200]
    expected, expected_frames = preprocessor(mono[None], torch.tensor([3200]))
    assert frames == expected_frames.item() == 20 and features.shape == (20, 16)
    torch.testing.assert_close(features, expected[0, :, :20].T, rtol=0, atol=0)
    empty, none = processor.materialize(AudioRef(torch.randn(100)))
    assert none == 0 and empty.shape == (0, 16)
    with pytest.raises(ValueError, match="tolerance"):
        processor.materialize(AudioRef(torch.randn(100), num_samples=100 + 8001))
    with pytest.raises(ValueError, match="float32"):
        processor.materialize(AudioRef(torch.randn(3200, dtype=torch.float64)))
    with pytest.raises(ValueError, match="slice_range"):
        processor.materialize(AudioRef(torch.randn(3200), slice_range=(5, 2)))


def test_decoded_pcm_clips():
    processor = _processor()
    pcm = (torch.randn(2, 1600) * 3000).to(torch.int16)
    lazy = AudioRef({"kind": "avdecoder", "decoder": [_Decoder([pcm, pcm])]}, sample_rate=None)
    assert processor.compute_num_frames(lazy) == 20
    features, frames = processor.materialize(lazy)
    waveform = (torch.cat([pcm, pcm], dim=-1).float() / 32767.0).mean(dim=0)
    direct, _ = processor.materialize(AudioRef(waveform))
    assert frames == 20
    torch.testing.assert_close(features, direct, rtol=0, atol=0)
    with pytest.raises(ValueError, match="Unsupported audio kind"):
        processor.materialize(AudioRef({"kind": "url"}))
    with pytest.raises(ValueError, match="AudioRef.data"):
        processor.materialize(AudioRef([0.0, 1.0]))
