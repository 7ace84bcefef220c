"""Vision encoder building blocks of multimodal models (``megatron.core.models.vision``)."""

from megatron_core.models.vision.clip_vit_model import CLIPViTModel, get_num_image_embeddings
from megatron_core.models.vision.multimodal_projector import MultimodalProjector
from megatron_core.models.vision.radio import RADIOViTModel
from megatron_core.models.vision.vit_layer_specs import (
    get_vit_layer_with_local_spec,
    get_vit_layer_with_transformer_engine_spec,
)

__all__ = [
    "CLIPViTModel",
    "MultimodalProjector",
    "RADIOViTModel",
    "get_num_image_embeddings",
    "get_vit_layer_with_local_spec",
    "get_vit_layer_with_transformer_engine_spec",
]
