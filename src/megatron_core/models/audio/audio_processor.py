"""Waveform -> log-mel features and embedding counts for the data pipeline (Megatron-Core's ``NemoAudioProcessor``).

The multimodal data pipeline asks it how many audio embeddings a clip becomes (to expand placeholders and pack
samples) and for the clip's log-mel features. A clip of ``n`` samples has ``n // hop_length`` mel frames; the
embedding count follows from :class:`~megatron_core.models.audio.audio_feature_config.NemoTransformerAudioTokenEstimator`.
Audio references are duck-typed (see :mod:`megatron_core.models.audio._audio_waveform`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.models.audio._audio_waveform import mono_waveform, num_samples
from megatron_core.models.audio.audio_feature_config import (
    NemoAudioFeatureConfig,
    NemoTransformerAudioTokenEstimator,
)
from megatron_core.models.audio.nemo_audio_preprocessing import AudioToMelSpectrogramPreprocessor

__all__ = ["NemoAudioProcessor"]


class NemoAudioProcessor:
    """Counts frames / embeddings of audio references and computes their log-mel features (eval mode: no dither)."""

    def __init__(self, *, token_estimator: NemoTransformerAudioTokenEstimator,
                 feature_config: NemoAudioFeatureConfig | None = None) -> None:
        self.token_estimator = token_estimator
        self.feature_config = feature_config or NemoAudioFeatureConfig()
        self._preprocessor = AudioToMelSpectrogramPreprocessor(**self.feature_config.to_nemo_kwargs()).eval()
        self._hop_length = int(self._preprocessor.hop_length)
        self._n_mels = int(self.feature_config.features)
        self._sample_rate = int(self.feature_config.sample_rate)

    @property
    def input_feature_dim(self) -> int:
        """Mel bins per frame (the encoder's ``n_mels``)."""
        return self._n_mels

    @property
    def sample_rate(self) -> int:
        """The sample rate waveforms must have, in Hz."""
        return self._sample_rate

    def _validate_sample_rate(self, audio_ref: Any, decoded_sample_rate: int | None = None) -> None:
        rate = audio_ref.sample_rate if audio_ref.sample_rate is not None else decoded_sample_rate
        if rate is not None and int(rate) != self.sample_rate:
            raise ValueError(f"Expected audio sample rate {self.sample_rate}, got {rate}. Resample raw waveforms "
                             "to the encoder sample rate before packing.")

    def _compute_num_frames_from_num_samples(self, num_samples: int) -> int:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        return int(num_samples // self._hop_length)

    def compute_num_frames(self, audio_ref: Any) -> int:
        """Mel frames of the clip ``audio_ref`` describes."""
        self._validate_sample_rate(audio_ref)
        return self._compute_num_frames_from_num_samples(num_samples(audio_ref))

    def num_frames_from_num_samples(self, num_samples: int) -> int:
        """Mel frames of the first ``num_samples`` samples (a slice ``[s, e)`` has ``f(e) - f(s)``)."""
        return self._compute_num_frames_from_num_samples(num_samples)

    def num_embeddings_from_num_samples(self, num_samples: int) -> int:
        """Audio embeddings of the first ``num_samples`` samples (a slice ``[s, e)`` has ``f(e) - f(s)``)."""
        return self.token_estimator.estimate_from_num_frames(self._compute_num_frames_from_num_samples(num_samples))

    def compute_num_embeddings(self, audio_ref: Any) -> int:
        """Audio embeddings the clip ``audio_ref`` describes becomes."""
        return self.token_estimator.estimate_from_num_frames(self.compute_num_frames(audio_ref))

    def materialize(self, audio_ref: Any) -> tuple[torch.Tensor, int]:
        """Decode the clip; its log-mel features ``[frames, n_mels]`` (float32) and frame count."""
        waveform, decoded_rate = mono_waveform(audio_ref)
        self._validate_sample_rate(audio_ref, decoded_rate)
        samples = int(waveform.shape[0])
        empty = torch.empty((0, self.input_feature_dim), dtype=torch.float32, device=waveform.device)
        if self._compute_num_frames_from_num_samples(samples) == 0:
            return empty, 0
        lengths = torch.tensor([samples], dtype=torch.long, device=waveform.device)
        mels, frames = self._preprocessor(waveform.unsqueeze(0), lengths)
        valid = int(frames[0])
        if valid == 0:
            return empty, 0
        return mels[0, :, :valid].transpose(0, 1).contiguous().to(torch.float32), valid
