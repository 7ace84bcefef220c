"""``YarnRotaryEmbedding`` at Megatron-Core's path; the code lives in
:mod:`megatron_core.transformer.yarn_rotary_pos_embedding`."""

from megatron_core.transformer.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding,
    _yarn_get_mscale,
    yarn_correction_range,
    yarn_inv_freq,
    yarn_mscale,
)

__all__ = ["YarnRotaryEmbedding", "_yarn_get_mscale", "yarn_correction_range", "yarn_inv_freq", "yarn_mscale"]
