"""Turning an ``AudioRef``-like object into a mono float32 waveform for :class:`NemoAudioProcessor`.

An audio reference is duck-typed: ``data`` (a float32 waveform ``[t]`` or ``[channels, t]``, or a dict
``{"kind": "avdecoder", "decoder": ...}`` for a lazily decoded clip), ``sample_rate``, ``num_samples`` (the full
source length) and ``slice_range`` (``(start, end)`` samples). Decoded integer PCM is scaled to ``[-1, 1)``.
A decoded clip may be up to 0.5 s shorter than ``num_samples`` (it is zero-padded); longer ones are cut.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_DURATION_TOLERANCE_SECONDS = 0.5
_BAD_DATA = ("AudioRef.data must be a raw float32 waveform tensor or a supported lazy audio spec for the "
             "Megatron multimodal audio path.")


def _clip_to_float32(clip: Any) -> torch.Tensor:
    clip = torch.as_tensor(clip)
    if clip.ndim == 1:
        clip = clip.unsqueeze(0)
    elif clip.ndim != 2:
        raise ValueError(f"Unsupported decoded audio clip shape {tuple(clip.shape)}.")
    if clip.dtype.is_floating_point:
        return clip.to(torch.float32).contiguous()
    if clip.dtype == torch.uint8:
        return ((clip.to(torch.float32) - 128.0) / 128.0).contiguous()
    if clip.dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        return (clip.to(torch.float32) / float(torch.iinfo(clip.dtype).max)).contiguous()
    raise ValueError(f"Unsupported decoded audio dtype {clip.dtype}.")


def _decoder_sample_rate(decoder: Any, sample_rate: int | None) -> int | None:
    if sample_rate is not None:
        return int(sample_rate)
    if hasattr(decoder, "get_audio_samples_per_second"):
        return int(decoder.get_audio_samples_per_second())
    if hasattr(decoder, "get_metadata"):
        metadata = decoder.get_metadata(get_video=False, get_video_duration=False, get_video_frame_count=False,
                                        get_video_frame_size=False, get_audio=True, get_audio_duration=False)
        rate = getattr(metadata, "audio_sample_rate", None)
        if rate is not None:
            return int(rate)
    return None


def _resolve_lazy_media(media: Any) -> Any:
    if hasattr(media, "get") and not hasattr(media, "get_audio"):
        media = media.get()
    if isinstance(media, (list, tuple)):
        if not media:
            raise ValueError("Lazy audio media resolved to an empty sequence.")
        media = media[0]
    return media


def _decode_avdecoder(decoder: Any, source_name: str, sample_rate: int | None) -> tuple[torch.Tensor, int | None]:
    decoder = _resolve_lazy_media(decoder)
    if not hasattr(decoder, "get_audio"):
        raise ValueError(f"Expected AVDecoder-like audio media for {source_name}, got {type(decoder).__name__}.")
    clips = getattr(decoder.get_audio(), "audio_clips", None)
    if not clips:
        raise ValueError(f"Decoded audio {source_name!r} did not contain audio clips.")
    waveform = torch.cat([_clip_to_float32(clip) for clip in clips], dim=-1)
    return waveform.contiguous(), _decoder_sample_rate(decoder, sample_rate)


def load_waveform(data: Any) -> tuple[torch.Tensor, int | None]:
    """``(waveform, decoded sample rate or None)`` of an audio reference's ``data``; float32 is required."""
    rate = None
    if torch.is_tensor(data):
        waveform = data
    elif isinstance(data, dict):
        if data.get("kind") != "avdecoder":
            raise ValueError(f"Unsupported audio kind {data.get('kind')!r}")
        waveform, rate = _decode_avdecoder(data["decoder"], data.get("source_name", "<avdecoder>"),
                                           data.get("sample_rate") or data.get("sampling_rate"))
    else:
        raise ValueError(_BAD_DATA)
    if waveform.dtype != torch.float32:
        raise ValueError(f"Expected raw float32 waveform tensor, got {waveform.dtype}.")
    if waveform.ndim not in (1, 2):
        raise ValueError(f"Unsupported waveform shape {tuple(waveform.shape)}. Expected [T] or [C, T].")
    return waveform, rate


def resolve_sample_rate(audio_ref: Any, decoded_rate: int | None) -> int | None:
    """The reference's sample rate, else the decoder's, else one named in a dict ``data``."""
    rate = audio_ref.sample_rate if audio_ref.sample_rate is not None else decoded_rate
    if rate is None and isinstance(audio_ref.data, dict):
        rate = audio_ref.data.get("sample_rate") or audio_ref.data.get("sampling_rate")
    return None if rate is None else int(rate)


def _slice_bounds(audio_ref: Any) -> tuple[int, int]:
    start, end = int(audio_ref.slice_range[0]), int(audio_ref.slice_range[1])
    return start, end


def mono_waveform(audio_ref: Any) -> tuple[torch.Tensor, int | None]:
    """The reference's mono waveform ``[t]`` (channels averaged), fitted to ``num_samples`` and sliced."""
    waveform, decoded_rate = load_waveform(audio_ref.data)
    if waveform.ndim == 2:
        waveform = waveform.mean(dim=0)
    if audio_ref.num_samples is not None:
        wanted = int(audio_ref.num_samples)
        missing = wanted - int(waveform.shape[0])
        rate = resolve_sample_rate(audio_ref, decoded_rate)
        tolerance = 0 if rate is None else int(_DURATION_TOLERANCE_SECONDS * rate + 0.999999)
        if missing > tolerance:
            raise ValueError(f"AudioRef.num_samples={wanted} exceeds waveform length {waveform.shape[0]} by "
                             f"{missing} samples, which is greater than the allowed tolerance {tolerance}.")
        waveform = F.pad(waveform, (0, missing)) if missing > 0 else waveform[:wanted]
    if audio_ref.slice_range is not None:
        start, end = _slice_bounds(audio_ref)
        if start < 0 or end < start:
            raise ValueError(f"AudioRef.slice_range must satisfy 0 <= start <= end, got {(start, end)}")
        waveform = waveform[start:end]
    return waveform.contiguous(), decoded_rate


def num_samples(audio_ref: Any) -> int:
    """Samples the reference covers: its slice, else ``num_samples``, else the decoded waveform's length."""
    if audio_ref.slice_range is not None:
        start, end = _slice_bounds(audio_ref)
        return max(0, end - start)
    if audio_ref.num_samples is not None:
        return int(audio_ref.num_samples)
    waveform, _ = load_waveform(audio_ref.data)
    return int(waveform.shape[-1])
