"""What the dynamic engine can serve, checked once when the engine is built.

Layers that cannot run with a KV-cache context raise only when a forward reaches them; inside the engine that
happens while serving, where the error is contained (every request in flight fails with "internal error while
generating"). :func:`check_model_supported` looks at the model's modules first and raises ``ValueError`` naming
the setting: with sequence parallelism under TP (whose steps the context pads to a multiple of the TP size)
speculative decoding, rollout routing replay and MoE token dropping, which would see the padding or each rank's
slice of the step only; gated delta net layers, DeepSeek sparse attention and absorbed MLA (no KV-cache
path, as in Megatron-Core 0.19), and every attention the context itself refuses (sliding windows, attention sinks, YaRN's
attention scaling, the offset / clamped SiLU GLU: ``BaseInferenceContext.check_attention_supported``).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.inference.contexts.step_layout import step_token_multiple
from megatron_core.ssm.gated_delta_net import GatedDeltaNet
from megatron_core.transformer.attention import Attention
from megatron_core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention

__all__ = ["check_model_supported"]


def check_model_supported(model: torch.nn.Module, config: Any, context: Any) -> None:
    """Raise ``ValueError`` if ``model`` (this rank's part, any wrapper around it) with its ``TransformerConfig``
    ``config`` has a setting or layer that ``context`` (a KV-cache inference context) cannot serve."""
    if step_token_multiple(config) > 1:
        _check_sequence_parallel_supported(config, context)
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


def _check_sequence_parallel_supported(config: Any, context: Any) -> None:
    """Refuse what a padded, sequence-split step cannot serve yet (each names the setting to change)."""
    where = (f"with sequence_parallel=True and tensor_model_parallel_size ({config.tensor_model_parallel_size}) > 1 "
             "(steps padded to a multiple of the TP size, split over the TP ranks)")
    drafts = getattr(context, "num_speculative_tokens", 0)
    if drafts:
        raise ValueError(f"the dynamic inference engine does not support num_speculative_tokens ({drafts}) {where}: "
                         "the MTP drafting step runs on the gathered logit rows; build the inference model with "
                         "sequence_parallel=False or serve without speculative decoding")
    if getattr(config, "moe_enable_routing_replay", False):
        raise ValueError(f"the dynamic inference engine does not support moe_enable_routing_replay {where}: each "
                         "rank's routers see only its slice of the step")
    capacity = getattr(config, "moe_expert_capacity_factor", None)
    if getattr(config, "num_moe_experts", None) and capacity is not None:
        raise ValueError(f"the dynamic inference engine does not support moe_expert_capacity_factor ({capacity}) "
                         f"{where}: the padding tokens would take expert capacity from real ones")
