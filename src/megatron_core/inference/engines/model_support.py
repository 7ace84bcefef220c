"""What the dynamic engine can serve, checked once when the engine is built.

Layers that cannot run with a KV-cache context raise only when a forward reaches them; inside the engine that
happens while serving, where the error is contained (every request in flight fails with "internal error while
generating"). :func:`check_model_supported` looks at the model's modules first and raises ``ValueError`` naming
the setting: sequence parallelism (Megatron-Core 0.19 pads each dynamic step to a multiple of the TP size; our
contexts lay out unpadded steps), gated delta net layers, DeepSeek sparse attention and absorbed MLA (no KV-cache
path, as in Megatron-Core 0.19), and every attention the context itself refuses (sliding windows, attention sinks, YaRN's
attention scaling, the offset / clamped SiLU GLU: ``BaseInferenceContext.check_attention_supported``).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.ssm.gated_delta_net import GatedDeltaNet
from megatron_core.transformer.attention import Attention
from megatron_core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention

__all__ = ["check_model_supported"]


def check_model_supported(model: torch.nn.Module, config: Any, context: Any) -> None:
    """Raise ``ValueError`` if ``model`` (this rank's part, any wrapper around it) with its ``TransformerConfig``
    ``config`` has a setting or layer that ``context`` (a KV-cache inference context) cannot serve."""
    tp = getattr(config, "tensor_model_parallel_size", 1)
    if getattr(config, "sequence_parallel", False) and tp > 1:
        raise ValueError(f"the dynamic inference engine does not support sequence_parallel=True with "
                         f"tensor_model_parallel_size ({tp}) > 1: its steps are not padded to a multiple of the "
                         "tensor-parallel size (build the inference model with sequence_parallel=False; MoE "
                         "layers under tensor parallelism therefore cannot be served)")
    for name, module in model.named_modules():
        if isinstance(module, GatedDeltaNet):
            raise ValueError(f"the dynamic inference engine cannot serve gated delta net layers ({name}: "
                             "experimental_attention_variant='gated_delta_net' or 'G' in hybrid_layer_pattern): "
                             "GatedDeltaNet has no KV-cache inference path (as in Megatron-Core 0.19)")
        if getattr(getattr(module, "core_attention", None), "requires_dsa_inputs", False):
            raise ValueError(f"the dynamic inference engine cannot serve DeepSeek sparse attention ({name}: "
                             "experimental_attention_variant='dsa' or 'D' in hybrid_layer_pattern): it has no "
                             "KV-cache inference path (as in Megatron-Core 0.19)")
        if isinstance(module, AbsorbedMLASelfAttention):
            raise ValueError(f"the dynamic inference engine cannot serve absorbed multi-latent attention ({name}: "
                             "AbsorbedMLASelfAttention): it has no KV-cache inference path (as in Megatron-Core 0.19)")
        if isinstance(module, Attention):
            context.check_attention_supported(module)
