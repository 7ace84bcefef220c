"""A numpy log-mel reference for the audio preprocessor tests, written from the definitions (float64).

Slaney mel scale (linear below 1 kHz at 200/3 Hz per mel, logarithmic above with 27 mels per factor 6.4),
triangular filters drawn with ``np.interp`` and scaled to unit area, frames cut by hand from the zero-padded signal.
"""

from __future__ import annotations

import numpy as np


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    return np.where(hz < 1000.0, hz * 3.0 / 200.0, 15.0 + 27.0 * np.log(np.maximum(hz, 1e-300) / 1000.0) / np.log(6.4))


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel < 15.0, mel * 200.0 / 3.0, 1000.0 * np.exp((mel - 15.0) * np.log(6.4) / 27.0))


def filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """``[n_mels, n_fft // 2 + 1]`` unit-area (Slaney) triangles."""
    bins = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    rows = []
    for i in range(n_mels):
        left, centre, right = edges[i], edges[i + 1], edges[i + 2]
        triangle = np.interp(bins, [left, centre, right], [0.0, 1.0, 0.0], left=0.0, right=0.0)
        rows.append(triangle * 2.0 / (right - left))
    return np.stack(rows)


def log_mel(signal: np.ndarray, lengths: list[int], *, sample_rate: int, win: int, hop: int, n_fft: int,
            n_mels: int, preemph: float | None, normalize: bool, mag_power: float = 2.0,
            guard: float = 2.0 ** -24, fb: np.ndarray | None = None,
            window: np.ndarray | None = None) -> tuple[np.ndarray, list[int]]:
    """Features ``[b, n_mels, frames]`` of ``signal`` ``[b, samples]`` (centred STFT, constant padding).

    ``fb``: the filterbank to use (default: :func:`filterbank` over 0 .. sample_rate / 2); ``window``: the
    ``win``-point window (default: the symmetric Hann window).
    """
    signal = np.asarray(signal, dtype=np.float64)
    batch, samples = signal.shape
    short_window = np.hanning(win) if window is None else window
    window = np.zeros(n_fft)
    start = (n_fft - win) // 2
    window[start:start + win] = short_window
    fb = filterbank(sample_rate, n_fft, n_mels, 0.0, sample_rate / 2.0) if fb is None else fb
    frames = 1 + samples // hop
    out = np.zeros((batch, n_mels, frames))
    valid_frames = [length // hop for length in lengths]
    for b in range(batch):
        x = signal[b].copy()
        if preemph is not None:
            x[1:] = signal[b, 1:] - preemph * signal[b, :-1]
            x[lengths[b]:] = 0.0
        padded = np.concatenate([np.zeros(n_fft // 2), x, np.zeros(n_fft // 2)])
        for t in range(frames):
            spectrum = np.fft.rfft(padded[t * hop:t * hop + n_fft] * window)
            power = np.abs(spectrum) ** mag_power
            out[b, :, t] = np.log(fb @ power + guard)
        if normalize:
            valid = out[b, :, :valid_frames[b]]
            mean = valid.mean(axis=1, keepdims=True)
            std = valid.std(axis=1, ddof=1, keepdims=True) + 1e-5
            out[b] = (out[b] - mean) / std
        out[b, :, valid_frames[b]:] = 0.0
    return out, valid_frames
