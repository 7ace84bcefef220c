"""Hybrid language models (Megatron-Core's ``models.hybrid``): Mamba, attention, MLP and MoE layers stacked by
a layer pattern such as ``"M*M-"``. :class:`HybridModel` is the model, :class:`HybridStack` its decoder."""

from megatron_core.models.hybrid.hybrid_model import HybridModel
from megatron_core.transformer.hybrid_stack import HybridStack, HybridStackSubmodules

__all__ = ["HybridModel", "HybridStack", "HybridStackSubmodules"]
