"""GPT checkpoints into hybrid models at Megatron-Core's path; the code lives in
:mod:`megatron_core.models.hybrid.gpt_checkpoint_interop` (it reads hybrid layer patterns, a model's
knowledge, which the storage layer does not have)."""

from megatron_core.models.hybrid.gpt_checkpoint_interop import (
    GPTCompatLayerMaps,
    gpt_compatible_layer_maps,
    retarget_fsdp_state_dict_to_gpt_checkpoint,
    retarget_sharded_state_dict_to_gpt_checkpoint,
)

__all__ = [
    "GPTCompatLayerMaps",
    "gpt_compatible_layer_maps",
    "retarget_fsdp_state_dict_to_gpt_checkpoint",
    "retarget_sharded_state_dict_to_gpt_checkpoint",
]
