"""Word, learned-position, rotary and YaRN rotary embeddings."""

from megatron_core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron_core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron_core.models.common.embeddings.rotary_pos_embedding import (
    MultimodalRotaryEmbedding,
    RotaryEmbedding,
)
from megatron_core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron_core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_mscale as _yarn_get_mscale,
)

__all__ = ["LanguageModelEmbedding", "MultimodalRotaryEmbedding", "RotaryEmbedding", "YarnRotaryEmbedding",
           "apply_rotary_pos_emb"]
