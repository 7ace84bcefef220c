"""TensorRT-LLM's weight names and the renaming of Megatron state-dict keys to them.

Megatron-Core's ``export.trtllm.trtllm_layers``. Names of per-layer weights are written without the layer
number (``transformer.layers.attention.qkv.weight``); the renaming puts the number back after ``layers.``
(``transformer.layers.3.attention.qkv.weight``). Each ``TRTLLMLayers`` member's value is that name.
"""

from __future__ import annotations

import re
from enum import Enum

_LAYER_NUMBER = re.compile(r"(?<=layers\.)(\d+)\.")


class TRTLLMLayers(Enum):
    """TensorRT-LLM weight names; a conversion dict maps Megatron keys (without layer numbers) to these."""

    # Used once per model (no layer number).
    position_embedding = "transformer.position_embedding.weight"
    vocab_embedding = "transformer.vocab_embedding.weight"
    lm_head = "lm_head.weight"
    final_layernorm_weight = "transformer.ln_f.weight"
    final_layernorm_bias = "transformer.ln_f.bias"

    # Attention.
    input_layernorm_weight = "transformer.layers.input_layernorm.weight"
    input_layernorm_bias = "transformer.layers.input_layernorm.bias"
    attention_qkv_weight = "transformer.layers.attention.qkv.weight"
    attention_qkv_bias = "transformer.layers.attention.qkv.bias"
    attention_dense_weight = "transformer.layers.attention.dense.weight"
    attention_dense_bias = "transformer.layers.attention.dense.bias"
    attention_linear_weight = "transformer.layers.attention.weight"  # nemotron-nas: attention replaced by a linear

    # MLP.
    mlp_fc_weight = "transformer.layers.mlp.fc.weight"
    mlp_fc_bias = "transformer.layers.mlp.fc.bias"
    post_layernorm_weight = "transformer.layers.post_layernorm.weight"
    post_layernorm_bias = "transformer.layers.post_layernorm.bias"
    mlp_projection_weight = "transformer.layers.mlp.proj.weight"
    mlp_projection_bias = "transformer.layers.mlp.proj.bias"

    # nemotron-nas FFN, and its FFN replaced by a linear.
    ffn_fc_weight = "transformer.layers.ffn.fc.weight"
    ffn_projection_weight = "transformer.layers.ffn.proj.weight"
    ffn_linear_weight = "transformer.layers.ffn.weight"

    # Mixture of experts.
    mlp_router_weight = "transformer.layers.mlp.router.weight"
    mlp_fc_weight_mixture_of_experts = "transformer.layers.mlp.fc.weight.expert"
    mlp_projection_weight_mixture_of_experts = "transformer.layers.mlp.proj.weight.expert"

    @staticmethod
    def return_layer_name_and_number(layer_name: str) -> tuple[str, int | None]:
        """``decoder.layers.2.mlp.linear_fc1.weight`` -> ``("decoder.layers.mlp.linear_fc1.weight", 2)``.

        The number is the first one right after ``layers.``; a name without one comes back unchanged with ``None``.
        """
        match = _LAYER_NUMBER.search(layer_name)
        if match is None:
            return layer_name, None
        return layer_name[: match.start()] + layer_name[match.end():], int(match.group(1))

    @staticmethod
    def rename_input_layer_names_to_trtllm_layer_names(
        model_state_dict: dict,
        trtllm_conversion_dict: dict,
        state_dict_split_by_layer_numbers: bool = True,
    ) -> dict:
        """Rename ``model_state_dict``'s keys (in place) to TensorRT-LLM names; returns the same dict.

        ``trtllm_conversion_dict`` maps Megatron keys without layer numbers to :class:`TRTLLMLayers`. Keys holding
        ``_extra_state`` or ``adapter_layer`` are dropped. With ``state_dict_split_by_layer_numbers`` (one entry per
        layer, ``decoder.layers.0.<...>``) every per-layer key must carry its number; ``False`` is for state dicts
        whose per-layer entries are stacked over layers (``decoder.layers.<...>`` of shape ``[num_layers, ...]``).

        Raises ``ValueError`` for a key the dict does not map, a mapping to something other than a
        ``TRTLLMLayers``, or a per-layer key without a number when ``state_dict_split_by_layer_numbers``.
        """
        for name in list(model_state_dict):
            if "_extra_state" in name or "adapter_layer" in name:
                del model_state_dict[name]
                continue
            name_without_number, number = TRTLLMLayers.return_layer_name_and_number(name)
            if state_dict_split_by_layer_numbers and number is None and "layers" in name_without_number:
                raise ValueError(
                    f"state-dict key {name!r} has no layer number but state_dict_split_by_layer_numbers is True; "
                    "pass state_dict_split_by_layer_numbers=False for weights stacked over layers"
                )
            if name_without_number not in trtllm_conversion_dict:
                raise ValueError(
                    f"no TensorRT-LLM name for state-dict key {name_without_number!r}: add it to the "
                    "trtllm_conversion_dict given to TRTLLMHelper (keys without layer numbers)"
                )
            target = trtllm_conversion_dict[name_without_number]
            if not isinstance(target, TRTLLMLayers):
                raise ValueError(
                    f"trtllm_conversion_dict[{name_without_number!r}] ({target!r}) must be a TRTLLMLayers member"
                )
            value = model_state_dict.pop(name)
            new_name = target.value
            if number is not None:
                new_name = new_name.replace("layers.", f"layers.{number}.", 1)
            model_state_dict[new_name] = value
        return model_state_dict


NON_TRANSFORMER_LAYERS_NAMES: list[str] = [
    TRTLLMLayers.vocab_embedding.value,
    TRTLLMLayers.position_embedding.value,
    TRTLLMLayers.lm_head.value,
    TRTLLMLayers.final_layernorm_weight.value,
    TRTLLMLayers.final_layernorm_bias.value,
]
"""TensorRT-LLM names of the weights outside the transformer layers (no layer number)."""


def get_layer_name_without_prefix(layer: TRTLLMLayers) -> str:
    """``TRTLLMLayers.attention_qkv_weight`` -> ``"attention.qkv.weight"`` (``transformer.layers.`` removed)."""
    return layer.value.replace("transformer.layers.", "")
