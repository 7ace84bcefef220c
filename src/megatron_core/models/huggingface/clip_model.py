"""A Hugging Face SigLIP vision encoder as a ``MegatronModule`` (Megatron-Core's ``SiglipHuggingFaceModel``).

The image encoder of a LLaVA-style model: ``transformers.AutoModel`` loaded from ``config.vision_model_type``
(``"hf://<name or directory>"``, normally a ``SiglipVisionModel``), returning its ``last_hidden_state``
``[b, patches, h]`` (SigLIP has no class token).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.models.huggingface._base import HuggingFaceModule
from megatron_core.models.huggingface._optional import (
    HAVE_TRANSFORMERS,
    TransformersClasses,
    transformers_attr,
)

__all__ = ["HAVE_TRANSFORMERS", "SiglipHuggingFaceModel"]


class SiglipHuggingFaceModel(HuggingFaceModule):
    """A SigLIP vision tower loaded with ``AutoModel`` from ``config.vision_model_type``."""

    # Units FSDP2 (``TorchFullyShardedDataParallel``) shards one by one: the encoder layers.
    _fsdp_modules = TransformersClasses("transformers.models.siglip.modeling_siglip", "SiglipEncoderLayer")

    def __init__(self, config: Any) -> None:
        auto_model = transformers_attr("transformers", "AutoModel", "SiglipHuggingFaceModel")
        super().__init__(config)
        self.model = auto_model.from_pretrained(config.vision_model_type.split("hf://")[1])

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The model's ``last_hidden_state`` ``[b, patches, h]`` for its usual inputs (``pixel_values``)."""
        return self.model(*args, **kwargs)["last_hidden_state"]
