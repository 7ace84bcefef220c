"""Loading Transformer Engine checkpoints into the Model Optimizer spec (Megatron-Core's
``post_training.modelopt.gpt.state_dict_hooks``).

Transformer Engine fuses each pre-norm into the following linear (``linear_qkv.layer_norm_weight``); the Model
Optimizer spec keeps the norm separate (``input_layernorm.weight``). :func:`mcore_gpt_load_te_state_dict_pre_hook`,
registered with ``module._register_load_state_dict_pre_hook``, renames the fused keys of a plain (not sharded)
state dict to the separate ones before loading, and drops a stored ``modelopt_state``.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["logger", "mcore_gpt_load_te_state_dict_pre_hook"]

logger = logging.getLogger(__name__)

# (fused Transformer Engine name, separate norm name), matched anywhere in a key.
_TE_TO_SEPARATE_NORMS = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.q_layernorm.weight"),
    ("self_attention.linear_q_up_proj.layer_norm_bias", "self_attention.q_layernorm.bias"),
    ("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.kv_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.layer_norm_bias", "self_attention.kv_layernorm.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
    ("mixer.in_proj.layer_norm_weight", "norm.weight"),
)


def mcore_gpt_load_te_state_dict_pre_hook(state_dict: dict[str, Any], prefix: str, local_metadata: dict,
                                          strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                                          error_msgs: list[str]) -> None:
    """Rename a Transformer Engine layer spec's fused norm keys in ``state_dict`` (in place) to the separate norms
    of the Model Optimizer spec, and drop ``modelopt_state``; ``load_state_dict``'s pre-hook signature."""
    state_dict.pop("modelopt_state", None)
    renames = []
    for key in state_dict:
        for fused, separate in _TE_TO_SEPARATE_NORMS:
            if fused in key:
                renames.append((key, key.replace(fused, separate)))
                break
    for old, new in renames:
        logger.info("replace %s with %s", old, new)
        state_dict[new] = state_dict.pop(old)
