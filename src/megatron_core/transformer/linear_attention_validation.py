"""Validation of the experimental attention variant and linear attention fields of ``TransformerConfig``.

``experimental_attention_variant="gated_delta_net"`` mixes gated delta net layers
(:class:`~megatron_core.ssm.gated_delta_net.GatedDeltaNet`) with softmax attention layers in a GPT decoder, as
``linear_attention_freq`` lays out; hybrid models place them with the ``G`` pattern symbol instead. DeepSeek sparse
attention (``"dsa"``) has its own rules in :mod:`.dsa_validation`. Each rule raises a ``ValueError`` naming fields
and values.
"""

from __future__ import annotations

from typing import Any

from megatron_core.transformer.dsa_validation import check_dsa_config

__all__ = ["EXPERIMENTAL_ATTENTION_VARIANTS", "check_experimental_attention_variant", "check_linear_attention_sizes"]

EXPERIMENTAL_ATTENTION_VARIANTS = ("gated_delta_net", "dsa")
_SIZE_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                "linear_num_value_heads")


def check_linear_attention_sizes(cfg: Any, tp_size: int, cp_size: int) -> None:
    """The ``linear_*`` sizes are positive, the key heads divide the value heads and ``tp_size * cp_size`` divides
    both head counts."""
    for name in _SIZE_FIELDS:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} ({value!r}) must be a positive integer for gated delta net layers")
    keys, values = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if values % keys:
        raise ValueError(f"linear_num_value_heads ({values}) must be a multiple of linear_num_key_heads ({keys}): "
                         "each key head serves a whole number of value heads")
    for name, heads in (("linear_num_key_heads", keys), ("linear_num_value_heads", values)):
        if heads % (tp_size * cp_size):
            raise ValueError(f"{name} ({heads}) must be divisible by tensor_model_parallel_size * "
                             f"context_parallel_size ({tp_size} * {cp_size} = {tp_size * cp_size})")


def _check_freq(cfg: Any) -> None:
    freq = cfg.linear_attention_freq
    if freq is None:
        return
    if isinstance(freq, bool) or not isinstance(freq, (int, list)):
        raise ValueError(f"linear_attention_freq ({freq!r}) must be an int or a list of 0/1 per layer")
    if isinstance(freq, int) and freq <= 0:
        raise ValueError(f"linear_attention_freq ({freq}) must be positive (one softmax-attention layer every "
                         f"linear_attention_freq layers)")
    if isinstance(freq, list) and (len(freq) != cfg.num_layers or any(x not in (0, 1) for x in freq)):
        raise ValueError(f"linear_attention_freq ({freq}) as a list must hold one 0 (softmax attention) or 1 "
                         f"(linear attention) per layer (num_layers={cfg.num_layers})")


def check_experimental_attention_variant(cfg: Any) -> None:
    """``experimental_attention_variant`` is None, ``"gated_delta_net"`` (which needs ``linear_attention_freq`` and
    valid ``linear_*`` sizes) or ``"dsa"`` (:func:`~.dsa_validation.check_dsa_config`); ``linear_attention_freq`` is
    an int > 0 or a 0/1 list of ``num_layers`` entries."""
    variant = cfg.experimental_attention_variant
    if variant is not None and variant not in EXPERIMENTAL_ATTENTION_VARIANTS:
        raise ValueError(f"experimental_attention_variant ({variant!r}) must be None or one of "
                         f"{list(EXPERIMENTAL_ATTENTION_VARIANTS)}")
    _check_freq(cfg)
    if variant == "gated_delta_net":
        if cfg.linear_attention_freq is None:
            raise ValueError("experimental_attention_variant='gated_delta_net' needs linear_attention_freq (an int N: "
                             "every N-th layer is softmax attention; or a 0/1 list per layer), got None")
        check_linear_attention_sizes(cfg, cfg.tensor_model_parallel_size, cfg.context_parallel_size)
    if variant == "dsa":
        check_dsa_config(cfg)
