"""``AudioToMelSpectrogramPreprocessor`` against a numpy log-mel written from the definitions (tests/models/audio/
mel_reference.py): the Slaney filterbank, features in float64 (1e-9) and through ``forward`` in fp32 (1e-4 against the
float64 reference: fp32 STFT rounding), frame counts, padding, normalisation modes and configuration errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_core.models.audio import NemoAudioFeatureConfig
from megatron_core.models.audio._mel_filterbank import hz_to_mel, mel_to_hz
from megatron_core.models.audio.nemo_audio_preprocessing import (
    CONSTANT,
    AudioToMelSpectrogramPreprocessor,
    normalize_batch,
    splice_frames,
)
from tests.models.audio.mel_reference import filterbank, log_mel

RATE, WIN, HOP, NFFT, MELS = 16000, 400, 160, 512, 40
LENGTHS = [4000, 3210, 1000]


def _preprocessor(**overrides) -> AudioToMelSpectrogramPreprocessor:
    kwargs = dict(sample_rate=RATE, window_size=0.025, window_stride=0.01, n_fft=NFFT, features=MELS, dither=0.0,
                  pad_to=0)
    return AudioToMelSpectrogramPreprocessor(**{**kwargs, **overrides}).eval()


def _signal(dtype=torch.float32) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(len(LENGTHS), max(LENGTHS), dtype=dtype)


def test_mel_scale_anchor_points():
    hz = torch.tensor([0.0, 500.0, 1000.0, 6400.0], dtype=torch.float64)
    torch.testing.assert_close(hz_to_mel(hz), torch.tensor([0.0, 7.5, 15.0, 42.0], dtype=torch.float64))
    torch.testing.assert_close(mel_to_hz(hz_to_mel(hz)), hz)


@pytest.mark.parametrize("fmax", [8000.0, 6000.0])
def test_filterbank_matches_reference(fmax: float):
    module = _preprocessor(highfreq=fmax, lowfreq=100.0)
    expected = filterbank(RATE, NFFT, MELS, 100.0, fmax)
    assert module.fb.shape == (1, MELS, NFFT // 2 + 1) and module.fb.dtype == torch.float32
    np.testing.assert_allclose(module.filter_banks[0].double().numpy(), expected, rtol=1e-6, atol=1e-9)


def test_filterbank_pnorm_and_none():
    plain = _preprocessor(mel_norm=None).fb[0].double().numpy()
    slaney = filterbank(RATE, NFFT, MELS, 0.0, RATE / 2)
    edges = np.nonzero(slaney)  # unnormalised triangles peak below 1 and share the slaney support
    assert plain.max() <= 1.0 + 1e-6 and np.array_equal(np.nonzero(plain), edges)
    unit = _preprocessor(mel_norm=2).fb[0].double()
    torch.testing.assert_close(unit.norm(dim=-1), torch.ones(MELS, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="mel_norm"):
        _preprocessor(mel_norm="l2")


@pytest.mark.parametrize("normalize", ["per_feature", None])
def test_features_float64_exact(normalize):
    module = _preprocessor(normalize=normalize)
    x = _signal(torch.float64)
    features, frames = module.get_features(x, torch.tensor(LENGTHS))
    expected, expected_frames = log_mel(x.numpy(), LENGTHS, sample_rate=RATE, win=WIN, hop=HOP, n_fft=NFFT,
                                        n_mels=MELS, preemph=0.97, normalize=normalize is not None,
                                        fb=module.fb[0].double().numpy(), window=module.window.double().numpy())
    np.testing.assert_allclose(module.window.double().numpy(), np.hanning(WIN), rtol=0, atol=5e-7)
    assert frames.tolist() == expected_frames == [n // HOP for n in LENGTHS]
    np.testing.assert_allclose(features.numpy(), expected, rtol=0, atol=1e-9)


def test_forward_fp32_against_float64_reference():
    module = _preprocessor(preemph=None, mag_power=1.0)
    x = _signal()
    features, frames = module(x, torch.tensor(LENGTHS))
    expected, _ = log_mel(x.double().numpy(), LENGTHS, sample_rate=RATE, win=WIN, hop=HOP, n_fft=NFFT, n_mels=MELS,
                          preemph=None, normalize=True, mag_power=1.0)
    assert features.dtype == torch.float32 and frames.dtype == torch.long
    np.testing.assert_allclose(features.double().numpy(), expected, rtol=0, atol=1e-4)


def test_padding_clamp_guard_and_exact_pad():
    module = _preprocessor(pad_to=16, pad_value=-1.0, log_zero_guard_type="clamp", log_zero_guard_value="tiny",
                           normalize=None)
    x = _signal(torch.float64)
    features, frames = module.get_features(x, torch.tensor(LENGTHS))
    assert features.shape[-1] == 32  # 26 STFT frames padded to a multiple of 16
    assert torch.all(features[2, :, frames[2]:] == -1.0)
    power = module.get_features(x, torch.tensor(LENGTHS), linear_spec=True)[0]
    mel = torch.log(torch.clamp(module.fb[0].double() @ power, min=torch.finfo(torch.float64).tiny))
    torch.testing.assert_close(features[0, :, :frames[0]], mel[0, :, :frames[0]], rtol=0, atol=1e-12)
    exact = _preprocessor(exact_pad=True, normalize=None)
    assert exact.stft_pad_amount == (NFFT - HOP) // 2
    valid = (4000 + 2 * exact.stft_pad_amount - NFFT) // HOP  # NeMo's count: one less than the STFT's frames
    assert exact.get_seq_len(torch.tensor([4000])).item() == valid
    assert exact.get_features(x, torch.tensor(LENGTHS))[0].shape[-1] == valid + 1


def test_zero_length_clip_and_dither_only_in_training():
    module = _preprocessor(dither=1e-3)
    x = _signal()
    _, frames = module(x, torch.tensor([4000, 0, 1000]))
    assert frames.tolist() == [25, 0, 6]
    again = module(x, torch.tensor(LENGTHS))[0]
    torch.testing.assert_close(module(x, torch.tensor(LENGTHS))[0], again, rtol=0, atol=0)
    before = x.clone()
    module.train()
    assert not torch.equal(module(x, torch.tensor(LENGTHS))[0], again)
    assert torch.equal(x, before)  # dither never writes into the caller's tensor


def test_normalize_batch_modes():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 7, dtype=torch.float64)
    seq_len = torch.tensor([7, 4])
    normed, mean, std = normalize_batch(x, seq_len, "per_feature")
    for b, n in enumerate(seq_len.tolist()):
        valid = x[b, :, :n]
        ref_std = valid.std(dim=1, keepdim=True) + CONSTANT
        torch.testing.assert_close(normed[b, :, :n], (valid - valid.mean(dim=1, keepdim=True)) / ref_std)
        assert torch.all(normed[b, :, n:] == 0)
    normed, mean, std = normalize_batch(x, seq_len, "all_features")
    torch.testing.assert_close(mean[1], x[1, :, :4].mean())
    torch.testing.assert_close(normed[1], (x[1] - x[1, :, :4].mean()) / (x[1, :, :4].std() + CONSTANT))
    fixed = {"fixed_mean": [[0.5] * 3] * 2, "fixed_std": [[2.0] * 3] * 2}
    torch.testing.assert_close(normalize_batch(x, seq_len, fixed)[0], (x - 0.5) / 2.0)
    assert normalize_batch(x, seq_len, "none")[0] is x
    with pytest.raises(ValueError, match="1 frame"):
        normalize_batch(x, torch.tensor([7, 1]), "per_feature")
    assert torch.equal(splice_frames(x, 3), torch.cat([x, x, x], dim=1))


def test_feature_config_builds_preprocessor_and_errors():
    cfg = NemoAudioFeatureConfig.from_dict({"features": 64, "_target_": "x", "unknown": 1})
    module = AudioToMelSpectrogramPreprocessor(**cfg.to_nemo_kwargs())
    assert (module.win_length, module.hop_length, module.n_fft, module.nfilt) == (400, 160, 512, 64)
    with pytest.raises(ValueError, match="n_window_size"):
        AudioToMelSpectrogramPreprocessor(window_size=0.02, n_window_size=320)
    with pytest.raises(ValueError, match="n_window_stride"):
        AudioToMelSpectrogramPreprocessor(window_size=None, window_stride=None, n_window_size=320)
    with pytest.raises(ValueError, match="log_zero_guard_type"):
        AudioToMelSpectrogramPreprocessor(log_zero_guard_type="max")
    with pytest.raises(NotImplementedError, match="even hop"):
        AudioToMelSpectrogramPreprocessor(window_stride=None, n_window_stride=161, exact_pad=True)
    signals, lengths = module.input_example(max_batch=2, max_dim=1000)
    assert signals.shape == (2, 1000) and lengths[0] == 1000
