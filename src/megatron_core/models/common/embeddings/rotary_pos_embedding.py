"""``RotaryEmbedding`` at Megatron-Core's path; the code lives in :mod:`megatron_core.transformer.rotary_pos_embedding`."""

from megatron_core.transformer.rotary_pos_embedding import (
    RotaryEmbedding,
    _llama3_scaled_inv_freq,
    apply_rotary_pos_emb,
)

__all__ = ["RotaryEmbedding", "_llama3_scaled_inv_freq", "apply_rotary_pos_emb"]
