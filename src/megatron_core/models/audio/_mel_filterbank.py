"""The Slaney-style mel filterbank of the NeMo preprocessor, in torch (what ``librosa.filters.mel(htk=False)`` gives).

Mel scale: linear below 1 kHz (``mel = hz / (200 / 3)``), logarithmic above (``27 / ln 6.4`` mels per e-fold).
``n_mels`` triangles span ``n_mels + 2`` equally spaced mel points; ``norm="slaney"`` scales each triangle to unit
area (``2 / (f[i + 2] - f[i])``), a number ``p`` divides each filter by its ``p``-norm, ``None`` leaves them as is.
Computed in float64, returned as float32 ``[1, n_mels, n_fft // 2 + 1]``.
"""

from __future__ import annotations

import math

import torch

_LINEAR_HZ_PER_MEL = 200.0 / 3.0
_LOG_START_HZ = 1000.0
_LOG_START_MEL = _LOG_START_HZ / _LINEAR_HZ_PER_MEL
_MELS_PER_LOG_STEP = math.log(6.4) / 27.0


def hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    """Slaney mel value of each frequency in Hz."""
    linear = hz / _LINEAR_HZ_PER_MEL
    logarithmic = _LOG_START_MEL + torch.log(hz.clamp_min(_LOG_START_HZ) / _LOG_START_HZ) / _MELS_PER_LOG_STEP
    return torch.where(hz >= _LOG_START_HZ, logarithmic, linear)


def mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    """Frequency in Hz of each Slaney mel value (inverse of :func:`hz_to_mel`)."""
    linear = mel * _LINEAR_HZ_PER_MEL
    logarithmic = _LOG_START_HZ * torch.exp(_MELS_PER_LOG_STEP * (mel.clamp_min(_LOG_START_MEL) - _LOG_START_MEL))
    return torch.where(mel >= _LOG_START_MEL, logarithmic, linear)


def _filter_norms(filters: torch.Tensor, norm: float) -> torch.Tensor:
    magnitude = filters.abs()
    if math.isinf(norm):
        return magnitude.amax(dim=-1, keepdim=True)
    if norm == 0:
        return (magnitude > 0).sum(dim=-1, keepdim=True).to(filters.dtype)
    return magnitude.pow(norm).sum(dim=-1, keepdim=True).pow(1.0 / norm)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float,
                   norm: str | float | None) -> torch.Tensor:
    """``[1, n_mels, n_fft // 2 + 1]`` float32 triangular filters over the rFFT bins (see the module docstring)."""
    if norm is not None and norm != "slaney" and (isinstance(norm, bool) or not isinstance(norm, (int, float))):
        raise ValueError(f"mel_norm ({norm!r}) must be 'slaney', None or a number (the p of a p-norm)")
    bin_hz = torch.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1, dtype=torch.float64)
    mel_edges = torch.linspace(float(hz_to_mel(torch.tensor(float(fmin), dtype=torch.float64))),
                               float(hz_to_mel(torch.tensor(float(fmax), dtype=torch.float64))),
                               n_mels + 2, dtype=torch.float64)
    edges_hz = mel_to_hz(mel_edges)
    left, centre, right = edges_hz[:-2, None], edges_hz[1:-1, None], edges_hz[2:, None]
    rising = (bin_hz - left) / (centre - left)
    falling = (right - bin_hz) / (right - centre)
    filters = torch.minimum(rising, falling).clamp_min(0.0)
    if norm == "slaney":
        filters = filters * (2.0 / (right - left))
    elif norm is not None:
        norms = _filter_norms(filters, float(norm))
        tiny = torch.finfo(filters.dtype).tiny
        filters = torch.where(norms > tiny, filters / norms.clamp_min(tiny), filters)
    return filters.to(torch.float32).unsqueeze(0)
