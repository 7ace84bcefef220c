"""Word, learned-position and rotary embeddings."""

from megatron_core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron_core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb

__all__ = ["LanguageModelEmbedding", "RotaryEmbedding", "apply_rotary_pos_emb"]
