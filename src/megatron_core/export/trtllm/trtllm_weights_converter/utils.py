"""Which activations are gated (Megatron-Core's ``trtllm_weights_converter.utils``)."""

from __future__ import annotations

from typing import Any

GATED_ACTIVATION: list[str] = ["swiglu", "geglu", "fast-swiglu", "fast-geglu"]
"""Activation names whose fc1 holds two halves (activated gate, linear input)."""


def is_gated_activation(helper: Any) -> bool:
    """Whether ``helper`` (a converter or ``TRTLLMHelper``: ``.activation``, ``.transformer_config``) is gated."""
    return helper.activation in GATED_ACTIVATION or bool(helper.transformer_config.gated_linear_unit)
