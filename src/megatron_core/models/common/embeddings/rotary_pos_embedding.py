"""``RotaryEmbedding`` and ``MultimodalRotaryEmbedding`` at Megatron-Core's path.

The angle modules live in :mod:`megatron_core.transformer.rotary_pos_embedding` and
:mod:`megatron_core.transformer.multimodal_rotary_pos_embedding`; ``apply_rotary_pos_emb`` and
``get_pos_emb_on_this_cp_rank`` are :mod:`.rope_utils`'s (Megatron-Core 0.19's signatures), as Megatron-Core
re-exports them here.
"""

from megatron_core.models.common.embeddings.rope_utils import (
           apply_rotary_pos_emb,
           get_pos_emb_on_this_cp_rank,
)
from megatron_core.transformer.multimodal_rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron_core.transformer.rotary_pos_embedding import RotaryEmbedding, _llama3_scaled_inv_freq

__all__ = ["MultimodalRotaryEmbedding", "RotaryEmbedding", "_llama3_scaled_inv_freq", "apply_rotary_pos_emb",
           "get_pos_emb_on_this_cp_rank"]
