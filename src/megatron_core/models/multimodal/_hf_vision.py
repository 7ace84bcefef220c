"""LLaVA's Hugging Face vision towers: ``vision_model_type="hf://<name or directory>"`` (Megatron-Core 0.19).

The tower is ``models.huggingface.build_hf_model(vision_config, vision_model_type)``: for a SigLIP model a
``SiglipHuggingFaceModel``, whose ``forward(images)`` returns the tower's ``last_hidden_state``
``[tiles, patches, h]`` (post-layernorm included, no class token). It is replicated on every tensor-parallel rank
and its parameters sit under ``vision_model.model.`` in LLaVA's state dict. Which families are accepted is decided
by ``clip_vit_model.get_num_image_embeddings`` (SigLIP only, else ``NotImplementedError``); this module checks that
the tower agrees with the sizes LLaVA was given, which Megatron-Core leaves to a shape error at the first forward.
"""

from __future__ import annotations

from typing import Any

from megatron_core.models.huggingface.module import HuggingFaceModule, build_hf_model
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["HF_SCHEME", "build_hf_vision_model", "is_hf_vision_type"]

HF_SCHEME = "hf://"


def build_hf_vision_model(vision_config: TransformerConfig, img_h: int, img_w: int,
                          patch_dim: int) -> HuggingFaceModule:
    """The wrapper of ``vision_config.vision_model_type``, checked against LLaVA's image geometry and width.

    ``vision_config.hidden_size`` sizes the projection's input, so it must equal the tower's width; the tower's
    position embeddings fix its image size and patch size, which must be ``img_h`` = ``img_w`` and ``patch_dim``
    (they give LLaVA's image-token count). A mismatch raises ``ValueError`` naming both values.
    """
    tower = build_hf_model(vision_config, vision_config.vision_model_type)
    hf_config = getattr(tower.model, "config", None)
    checks = (("hidden_size", "vision_transformer_config.hidden_size", vision_config.hidden_size),
              ("image_size", "img_h", img_h), ("image_size", "img_w", img_w), ("patch_size", "patch_dim", patch_dim))
    for field, ours, value in checks:
        theirs = getattr(hf_config, field, None)
        if theirs is not None and theirs != value:
            raise ValueError(f"{ours} ({value}) must equal the Hugging Face vision model's {field} ({theirs}) "
                             f"for vision_model_type {vision_config.vision_model_type!r}")
    return tower


def is_hf_vision_type(vision_model_type: Any) -> bool:
    """Whether ``vision_model_type`` names a Hugging Face tower (``"hf://..."``)."""
    return isinstance(vision_model_type, str) and vision_model_type.startswith(HF_SCHEME)
