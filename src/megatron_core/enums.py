"""Model-level enums (Megatron-Core's ``megatron.core.enums``).

``ModelType`` is the same class as ``megatron_core.transformer.enums.ModelType``.
"""

from __future__ import annotations

import enum

from megatron_core.transformer.enums import ModelType


class Fp8Recipe(str, enum.Enum):
    """FP8 scaling recipes by name."""

    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"
    custom = "custom"


class Fp4Recipe(str, enum.Enum):
    """FP4 scaling recipes by name."""

    nvfp4 = "nvfp4"
    custom = "custom"


__all__ = ["Fp4Recipe", "Fp8Recipe", "ModelType"]
