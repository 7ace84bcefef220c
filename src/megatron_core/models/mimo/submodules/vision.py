"""``VisionModalitySubmodules``: image encoders and at most one input and one output projection."""

from __future__ import annotations

from megatron_core.models.mimo.submodules.base import EncoderOnlyModalitySubmodules


class VisionModalitySubmodules(EncoderOnlyModalitySubmodules):
    """Vision modality of a MIMO model: encoders plus at most one input and one output projection; no decoder."""


__all__ = ["VisionModalitySubmodules"]
