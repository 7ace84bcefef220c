"""Log-mel features for the NeMo audio encoder, in plain torch (``models.audio.nemo_audio_preprocessing``).

:class:`AudioToMelSpectrogramPreprocessor` computes what NeMo's ASR preprocessor of the same name computes, without
NeMo, librosa or Lightning: optional dither (training only), pre-emphasis ``x[t] - a * x[t - 1]`` inside each clip,
an STFT with a symmetric window zero-padded to ``n_fft`` (``center=True`` with constant padding, or ``exact_pad``),
magnitude to ``mag_power``, the Slaney mel filterbank, ``log`` with a zero guard, per-feature normalisation over each
clip's valid frames, and ``pad_value`` past them. A clip of ``n`` samples has ``n // hop_length`` valid frames
(``center=True``): the STFT's last frame is dropped, as NeMo does.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from megatron_core.models.audio._mel_filterbank import mel_filterbank

__all__ = ["CONSTANT", "AudioToMelSpectrogramPreprocessor", "normalize_batch", "splice_frames"]

CONSTANT = 1e-5
"""Added to the standard deviation in :func:`normalize_batch` (NeMo's guard against silent clips)."""

_WINDOWS = {"hann": torch.hann_window, "hamming": torch.hamming_window, "blackman": torch.blackman_window,
            "bartlett": torch.bartlett_window}


def _valid_frames(seq_len: torch.Tensor, max_time: int) -> torch.Tensor:
    return torch.arange(max_time, device=seq_len.device)[None, :] < seq_len[:, None]


def normalize_batch(x: torch.Tensor, seq_len: torch.Tensor, normalize_type: Any
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Normalise features ``x`` ``[b, features, time]``; returns ``(normalised, mean, std)``.

    ``"per_feature"``: each clip's features over its ``seq_len`` valid frames (unbiased std + ``CONSTANT``;
    frames past the end become 0). ``"all_features"``: one mean and std per clip. A mapping with ``fixed_mean``
    and ``fixed_std``: those constants. Anything else: ``x`` unchanged.
    """
    if normalize_type == "per_feature":
        # The length-1 check syncs with the device; on CUDA it is skipped while a graph is being captured.
        capturing = x.is_cuda and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
        if not capturing and bool(torch.any(seq_len == 1)):
            raise ValueError("normalize_batch('per_feature') got a clip with 1 frame: its std is undefined; give "
                             "every clip at least hop_length samples")
        valid = _valid_frames(seq_len, x.shape[2])[:, None, :]
        count = valid.sum(dim=2)
        mean = torch.where(valid, x, 0.0).sum(dim=2) / count
        centred = torch.where(valid, x - mean[:, :, None], 0.0)
        std = torch.sqrt(centred.pow(2).sum(dim=2) / (count - 1.0))
        std = std.masked_fill(std.isnan(), 0.0) + CONSTANT
        normalized = ((x - mean[:, :, None]) / std[:, :, None]).masked_fill(~valid, 0.0)
        return normalized, mean, std
    if normalize_type == "all_features":
        mean = torch.stack([x[i, :, :int(n)].mean() for i, n in enumerate(seq_len.tolist())])
        std = torch.stack([x[i, :, :int(n)].std() for i, n in enumerate(seq_len.tolist())]) + CONSTANT
        return (x - mean.view(-1, 1, 1)) / std.view(-1, 1, 1), mean, std
    if isinstance(normalize_type, Mapping) and "fixed_mean" in normalize_type and "fixed_std" in normalize_type:
        mean = torch.tensor(normalize_type["fixed_mean"], device=x.device)
        std = torch.tensor(normalize_type["fixed_std"], device=x.device)
        shape = (x.shape[0], x.shape[1], 1)
        return (x - mean.view(shape)) / std.view(shape), mean, std
    return x, None, None


def splice_frames(x: torch.Tensor, frame_splicing: int) -> torch.Tensor:
    """``frame_splicing`` copies of ``x`` ``[b, features, time]`` along the features, as NeMo's ``splice_frames``.

    NeMo's version concatenates ``x[..., :n]`` and ``x[..., n:]``, which rebuilds ``x`` unshifted; this keeps
    that behaviour so that features match NeMo-trained checkpoints.
    """
    return torch.cat([x] * frame_splicing, dim=1)


class AudioToMelSpectrogramPreprocessor(nn.Module):
    """Waveforms ``[b, samples]`` + lengths -> log-mel features ``[b, features, frames]`` + frame counts.

    Same constructor arguments and buffers (``window``, ``fb``) as NeMo's class; ``use_torchaudio``,
    ``stft_exact_pad`` and ``stft_conv`` are accepted and ignored, as in Megatron-Core.
    """

    def __init__(self, sample_rate: int = 16000, window_size: float | None = 0.02, window_stride: float | None = 0.01,
                 n_window_size: int | None = None, n_window_stride: int | None = None, window: str = "hann",
                 normalize: Any = "per_feature", n_fft: int | None = None, preemph: float | None = 0.97,
                 features: int = 64, lowfreq: float = 0, highfreq: float | None = None, log: bool = True,
                 log_zero_guard_type: str = "add", log_zero_guard_value: float | str = 2**-24,
                 dither: float = 1e-5, pad_to: int | str = 16, frame_splicing: int = 1, exact_pad: bool = False,
                 pad_value: float = 0, mag_power: float = 2.0, rng: random.Random | None = None,
                 nb_augmentation_prob: float = 0.0, nb_max_freq: int = 4000, mel_norm: str | float | None = "slaney",
                 use_torchaudio: bool = False, stft_exact_pad: bool = False, stft_conv: bool = False) -> None:
        del use_torchaudio, stft_exact_pad, stft_conv
        super().__init__()
        if window_size and n_window_size:
            raise ValueError(f"window_size ({window_size}) and n_window_size ({n_window_size}): give only one")
        if window_stride and n_window_stride:
            raise ValueError(f"window_stride ({window_stride}) and n_window_stride ({n_window_stride}): give only one")
        if window_size:
            n_window_size = int(window_size * sample_rate)
        if window_stride:
            n_window_stride = int(window_stride * sample_rate)
        for name, value in (("n_window_size", n_window_size), ("n_window_stride", n_window_stride)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} ({value!r}) must be a positive int (or set the matching *_size/*_stride "
                                 "in seconds)")
        if exact_pad and n_window_stride % 2 == 1:
            raise NotImplementedError(f"exact_pad=True needs an even hop length, got n_window_stride={n_window_stride}")
        if log_zero_guard_type not in ("add", "clamp"):
            raise ValueError(f"log_zero_guard_type ({log_zero_guard_type!r}) must be 'add' or 'clamp'")
        self._sample_rate = sample_rate
        self.win_length = n_window_size
        self.hop_length = n_window_stride
        self.n_fft = n_fft or 2 ** math.ceil(math.log2(self.win_length))
        self.stft_pad_amount = (self.n_fft - self.hop_length) // 2 if exact_pad else None
        self.exact_pad = exact_pad
        self.normalize = normalize
        self.log = log
        self.dither = dither
        self.frame_splicing = frame_splicing
        self.nfilt = features
        self.preemph = preemph
        self.pad_to = pad_to
        self.pad_value = pad_value
        self.mag_power = mag_power
        self.log_zero_guard_type = log_zero_guard_type
        self.log_zero_guard_value = log_zero_guard_value
        self._rng = random.Random() if rng is None else rng
        self.nb_augmentation_prob = nb_augmentation_prob
        window_fn = _WINDOWS.get(window)
        self.register_buffer("window", window_fn(self.win_length, periodic=False) if window_fn else None)
        self.register_buffer("fb", mel_filterbank(sample_rate, self.n_fft, features, lowfreq,
                                                  highfreq or sample_rate / 2, mel_norm))
        max_length = self.get_seq_len(torch.tensor(16.7 * sample_rate, dtype=torch.float))
        self.max_length = max_length + (pad_to - max_length % pad_to if isinstance(pad_to, int) and pad_to > 0 else 0)
        if self.nb_augmentation_prob > 0.0:
            if nb_max_freq >= sample_rate / 2:
                self.nb_augmentation_prob = 0.0
            else:
                self._nb_max_fft_bin = int(nb_max_freq / sample_rate * self.n_fft)
        self.register_buffer("dtype_sentinel_tensor", torch.tensor((), dtype=torch.float32), persistent=False)

    @property
    def filter_banks(self) -> torch.Tensor:
        """The mel filterbank ``[1, features, n_fft // 2 + 1]``."""
        return self.fb

    def input_example(self, max_batch: int = 8, max_dim: int = 32000, min_length: int = 200
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random ``(signals [max_batch, max_dim], lengths [max_batch])`` for tracing; the first clip is full."""
        device = self.filter_banks.device
        signals = torch.randn(max_batch, max_dim, device=device)
        lengths = torch.randint(min_length, max_dim, (max_batch,), device=device)
        lengths[0] = max_dim
        return signals, lengths

    def get_seq_len(self, seq_len: torch.Tensor) -> torch.Tensor:
        """Valid frames (int64) of clips of ``seq_len`` samples."""
        pad = 2 * self.stft_pad_amount if self.stft_pad_amount is not None else self.n_fft // 2 * 2
        return torch.floor_divide(seq_len + pad - self.n_fft, self.hop_length).to(torch.long)

    def log_zero_guard_value_fn(self, x: torch.Tensor) -> float:
        """The log guard as a number: the configured value, or ``finfo(x.dtype)``'s ``tiny`` / ``eps``."""
        guard = self.log_zero_guard_value
        if not isinstance(guard, str):
            return guard
        if guard in ("tiny", "eps"):
            return getattr(torch.finfo(x.dtype), guard)
        raise ValueError(f"log_zero_guard_value ({guard!r}) must be a number, 'tiny' or 'eps'")

    def stft(self, x: torch.Tensor) -> torch.Tensor:
        """Complex STFT ``[b, n_fft // 2 + 1, frames]`` of ``x`` ``[b, samples]`` (zero padding when centred)."""
        # The window follows a floating-point signal's dtype (fp32 from ``forward``; float64 for exact checks).
        dtype = x.dtype if x.is_floating_point() else torch.float
        window = self.window.to(dtype=dtype, device=x.device) if self.window is not None else None
        return torch.stft(x, n_fft=self.n_fft, hop_length=self.hop_length, win_length=self.win_length,
                          center=not self.exact_pad, window=window, return_complex=True, pad_mode="constant")

    @torch.no_grad()
    def get_features(self, input_signal: torch.Tensor, length: torch.Tensor, linear_spec: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features [b, features, frames], valid frames [b])``; ``linear_spec``: the spectrogram before the mel."""
        seq_len = torch.where(length == 0, 0, self.get_seq_len(length))
        x = input_signal
        if self.stft_pad_amount is not None:
            x = nn.functional.pad(x, (self.stft_pad_amount, self.stft_pad_amount))
        if self.training and self.dither > 0:
            x = x + self.dither * torch.randn_like(x)
        if self.preemph is not None:
            x = torch.cat((x[:, :1], x[:, 1:] - self.preemph * x[:, :-1]), dim=1)
            x = x.masked_fill(~_valid_frames(length, x.shape[1]), 0.0)
        with torch.amp.autocast(x.device.type, enabled=False):
            spectrum = self.stft(x)
        x = torch.view_as_real(spectrum).pow(2).sum(-1).sqrt()
        if self.training and self.nb_augmentation_prob > 0.0:
            for clip in range(x.shape[0]):
                if self._rng.random() < self.nb_augmentation_prob:
                    x[clip, self._nb_max_fft_bin:, :] = 0.0
        if self.mag_power != 1.0:
            x = x.pow(self.mag_power)
        if linear_spec:
            return x, seq_len
        with torch.amp.autocast(x.device.type, enabled=False):
            x = torch.matmul(self.fb.to(x.dtype), x)
        if self.log:
            guard = self.log_zero_guard_value_fn(x)
            x = torch.log(x + guard) if self.log_zero_guard_type == "add" else torch.log(x.clamp_min(guard))
        if self.frame_splicing > 1:
            x = splice_frames(x, self.frame_splicing)
        if self.normalize:
            x, _, _ = normalize_batch(x, seq_len, normalize_type=self.normalize)
        x = x.masked_fill(~_valid_frames(seq_len, x.shape[-1])[:, None, :], self.pad_value)
        if self.pad_to == "max":
            x = nn.functional.pad(x, (0, int(self.max_length) - x.shape[-1]), value=self.pad_value)
        elif self.pad_to > 0 and x.shape[-1] % self.pad_to:
            x = nn.functional.pad(x, (0, self.pad_to - x.shape[-1] % self.pad_to), value=self.pad_value)
        return x, seq_len

    @torch.no_grad()
    def forward(self, input_signal: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Features of ``input_signal`` (computed in fp32, returned in the module's dtype) and valid frame counts."""
        features, frames = self.get_features(input_signal.to(torch.float32), length)
        return features.to(self.dtype_sentinel_tensor.dtype), frames
