"""Model-level enums (Megatron-Core's ``megatron.core.enums``).

``ModelType`` is defined here and re-exported as ``megatron_core.transformer.enums.ModelType`` (one class);
so is ``AttnMaskType``, which the softmax in ``fusions`` (below ``transformer``) reads, re-exported as
``megatron_core.transformer.enums.AttnMaskType``. Megatron-Core's ``megatron.core.enums`` does not list it.
"""

from __future__ import annotations

import enum


class ModelType(enum.Enum):
    """Kind of model, which decides how pipeline stages exchange tensors."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2


class AttnMaskType(enum.Enum):
    """How the attention mask is formed. A mask tensor is boolean, ``True`` = masked out."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
    causal_bottom_right = 6


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
