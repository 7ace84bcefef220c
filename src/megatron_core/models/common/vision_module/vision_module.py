"""``VisionModule`` (Megatron-Core's ``models.common.vision_module``): the base class of vision encoders.

It adds nothing to ``MegatronModule`` (as in Megatron-Core 0.19); it marks vision encoders such as
``CLIPViTModel`` so code can tell them from language models.
"""

from __future__ import annotations

from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["VisionModule"]


class VisionModule(MegatronModule):
    """A ``MegatronModule`` that encodes images (the common base of CLIP-style vision models)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config=config)
