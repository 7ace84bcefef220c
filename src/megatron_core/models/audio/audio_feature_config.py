"""Audio front-end descriptors of Megatron-Core's NeMo-style audio encoder (``models.audio.audio_feature_config``).

``NemoAudioFeatureConfig`` holds the keyword arguments of the log-mel preprocessor
(:class:`~megatron_core.models.audio.nemo_audio_preprocessing.AudioToMelSpectrogramPreprocessor`), with the
defaults of NeMo's ``transformer_stacking`` recipe. ``NemoTransformerAudioTokenEstimator`` turns a mel-frame
count into the number of audio embeddings the encoder and projector produce. Both use the standard library only,
so the data pipeline can import them without torch models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["NemoAudioFeatureConfig", "NemoTransformerAudioTokenEstimator", "ceil_div"]

_PRE_ENCODES = ("conv", "depth_conv", "stacking")


def ceil_div(value: int, divisor: int) -> int:
    """``ceil(value / divisor)`` for integers; ``ValueError`` unless ``divisor > 0``."""
    if divisor <= 0:
        raise ValueError(f"divisor must be > 0, got {divisor}")
    return -(-value // divisor)


@dataclass
class NemoAudioFeatureConfig:
    """Keyword arguments of NeMo's ``AudioToMelSpectrogramPreprocessor`` (Slaney mel, per-feature normalisation).

    Defaults: 16 kHz audio, 25 ms windows every 10 ms, a 512-point FFT, 128 mel bins, 0.97 pre-emphasis and
    ``log(x + 2**-24)``.
    """

    sample_rate: int = 16000
    window_size: float = 0.025
    window_stride: float = 0.01
    n_window_size: int | None = None
    n_window_stride: int | None = None
    window: str = "hann"
    normalize: str | None = "per_feature"
    n_fft: int | None = 512
    preemph: float | None = 0.97
    features: int = 128
    lowfreq: float = 0.0
    highfreq: float | None = None
    log: bool = True
    log_zero_guard_type: str = "add"
    log_zero_guard_value: Any = 2**-24
    dither: float = 1e-5
    pad_to: int = 0
    frame_splicing: int = 1
    exact_pad: bool = False
    pad_value: float = 0.0
    mag_power: float = 2.0
    nb_augmentation_prob: float = 0.0
    nb_max_freq: int = 4000
    mel_norm: str = "slaney"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NemoAudioFeatureConfig:
        """The config from ``data``; keys that are not fields (``_target_``, NeMo-only options) are dropped."""
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})

    def to_nemo_kwargs(self) -> dict[str, Any]:
        """Every field as a keyword argument of ``AudioToMelSpectrogramPreprocessor``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class NemoTransformerAudioTokenEstimator:
    """Mel frames -> audio embeddings for the NeMo transformer encoder followed by a stacking projector.

    Convolutional pre-encoders (``"conv"``, ``"depth_conv"``) floor-divide lengths at each stride-2 layer;
    the ``"stacking"`` pre-encoder keeps a partial last stack, so its count is a ceiling division.
    ``encoder_time_stride`` has no default on purpose: take it from the encoder's config
    (``NemoTransformerAudioConfig.encoder_time_stride``), which depends on ``pre_encode`` and
    ``subsampling_factor``.
    """

    encoder_time_stride: int
    stack_factor: int = 1
    pre_encode: str = "conv"

    def _estimate_encoder_steps(self, num_frames: int, padded_num_frames: int | None = None) -> int:
        if num_frames < 0:
            raise ValueError(f"num_frames must be >= 0, got {num_frames}")
        if padded_num_frames is not None and padded_num_frames < num_frames:
            raise ValueError(f"padded_num_frames={padded_num_frames} must be >= num_frames={num_frames}")
        if self.pre_encode in ("conv", "depth_conv"):
            return num_frames // self.encoder_time_stride
        if self.pre_encode == "stacking":
            return ceil_div(num_frames, self.encoder_time_stride)
        raise ValueError(f"pre_encode ({self.pre_encode!r}) must be one of {list(_PRE_ENCODES)}")

    def estimate(self, num_frames: int, padded_num_frames: int | None = None) -> int:
        """Audio embeddings for ``num_frames`` mel frames (after the encoder, then ``stack_factor`` stacking)."""
        return math.ceil(self._estimate_encoder_steps(num_frames, padded_num_frames) / self.stack_factor)

    def estimate_from_num_frames(self, num_frames: int, padded_num_frames: int | None = None) -> int:
        """Same as :meth:`estimate`."""
        return self.estimate(num_frames, padded_num_frames)

    def __call__(self, num_frames: int, padded_num_frames: int | None = None) -> int:
        """Same as :meth:`estimate`."""
        return self.estimate(num_frames, padded_num_frames)
