"""Bias + dropout + residual add (Megatron-Core's ``fused_bias_dropout``) at Megatron-Core's path.

The code lives in :mod:`megatron_core.transformer.bias_dropout_add`; this alias re-exports
``get_bias_dropout_add`` and the train/inference variants.
"""

from megatron_core.transformer.bias_dropout_add import (
    bias_dropout_add_fused_inference,
    bias_dropout_add_fused_train,
    bias_dropout_add_unfused,
    get_bias_dropout_add,
)

__all__ = ["bias_dropout_add_fused_inference", "bias_dropout_add_fused_train", "bias_dropout_add_unfused",
           "get_bias_dropout_add"]
