"""Decoder layer specs of LLaVA's language model (Megatron-Core's ``models.multimodal.llava_spec``).

A pre-norm GPT layer with causal self-attention and a dense or MoE MLP. ``decoder_model_with_local_default_spec``
is pure PyTorch plus this library's tensor-parallel layers (separate norms, under their own checkpoint names);
``decoder_model_with_transformer_engine_default_spec`` uses Transformer Engine's fused norm + linear modules and
raises ``ImportError`` naming the ``te`` extra when it is missing, as the GPT specs do. As in Megatron-Core, only the
Transformer Engine spec builds q/k norms for ``qk_layernorm``, and its MoE layers have no norm before the experts.
"""

from __future__ import annotations

from megatron_core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron_core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron_core.transformer.backend_specs import pre_norm_layer_submodules, self_attention_spec
from megatron_core.transformer.backends import te_spec_provider
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.transformer_layer import TransformerLayer

__all__ = ["decoder_model_with_local_default_spec", "decoder_model_with_transformer_engine_default_spec"]


def _decoder_layer(backend: BackendSpecProvider, num_experts: int | None, moe_grouped_gemm: bool,
                   qk_norm: type | None) -> ModuleSpec:
    attention = self_attention_spec(backend, AttnMaskType.causal, qk_norm)
    mlp = get_mlp_module_spec_for_backend(backend, num_experts, moe_grouped_gemm)
    return ModuleSpec(module=TransformerLayer,
                      submodules=pre_norm_layer_submodules(backend, attention, mlp, map_norm_keys=False))


def decoder_model_with_transformer_engine_default_spec(
    num_experts: int | None = None, moe_grouped_gemm: bool = False, qk_layernorm: bool = False
) -> ModuleSpec:
    """The LLaVA decoder layer on Transformer Engine modules (q/k norms with ``qk_layernorm``)."""
    backend = te_spec_provider()
    qk_norm = backend.layer_norm(for_qk=True) if qk_layernorm else None
    return _decoder_layer(backend, num_experts, moe_grouped_gemm, qk_norm)


def decoder_model_with_local_default_spec(
    num_experts: int | None = None, moe_grouped_gemm: bool = False, qk_layernorm: bool = False
) -> ModuleSpec:
    """The LLaVA decoder layer on local modules; ``qk_layernorm`` is accepted and, as in Megatron-Core, not used."""
    return _decoder_layer(LocalSpecProvider(), num_experts, moe_grouped_gemm, None)
