"""``VisionModule``: the base class of vision encoders."""

from megatron_core.models.common.vision_module.vision_module import VisionModule

__all__ = ["VisionModule"]
