"""MoE layer specs (Megatron-Core's ``models/gpt/moe_module_specs``).

``get_moe_module_spec_for_backend`` builds an ``MoELayer`` spec whose routed experts are a
``SequentialMLP`` of the backend's tensor-parallel linears, or (``moe_grouped_gemm``) the backend's
grouped experts, and whose shared experts use the same linears. ``get_inference_optimized_moe_spec`` is the
MoE block of the inference-optimized specs: ``InferenceTopKRouter`` and ``InferenceGroupedMLP`` on the
``InferenceSpecProvider``'s grouped linears (the checkpoint keys of grouped experts).
"""

from __future__ import annotations

from megatron_core.models.backends import BackendSpecProvider, InferenceSpecProvider, LocalSpecProvider
from megatron_core.transformer.backends import te_spec_provider
from megatron_core.transformer.mlp import MLPSubmodules
from megatron_core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron_core.transformer.moe.router import InferenceTopKRouter
from megatron_core.transformer.moe.shared_experts import SharedExpertMLP
from megatron_core.transformer.spec_utils import ModuleSpec

__all__ = ["get_inference_optimized_moe_spec", "get_moe_module_spec", "get_moe_module_spec_for_backend"]


def get_moe_module_spec_for_backend(backend: BackendSpecProvider, num_experts: int | None = None,
                                    moe_grouped_gemm: bool | None = False,
                                    use_te_activation_func: bool = False) -> ModuleSpec:
    """An ``MoELayer`` spec from ``backend``'s layers."""
    if num_experts is None:
        raise ValueError("get_moe_module_spec_for_backend needs num_experts")
    mlp = MLPSubmodules(linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear(),
                        activation_func=backend.activation_func())
    experts = backend.grouped_mlp_modules(bool(moe_grouped_gemm))
    shared = ModuleSpec(module=SharedExpertMLP, submodules=mlp)
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=experts, shared_experts=shared))


def get_moe_module_spec(use_te: bool | None = True, num_experts: int | None = None,
                        moe_grouped_gemm: bool | None = False) -> ModuleSpec:
    """An ``MoELayer`` spec for the Transformer Engine (``use_te``) or the local backend."""
    if use_te:
        return get_moe_module_spec_for_backend(te_spec_provider(), num_experts, moe_grouped_gemm)
    return get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts, moe_grouped_gemm)


def get_inference_optimized_moe_spec() -> ModuleSpec:
    """An ``MoELayer`` spec for inference: ``InferenceTopKRouter`` (dense top-k routing under an inference engine),
    ``InferenceGroupedMLP`` experts and ``SharedExpertMLP`` shared experts on ``InferenceSpecProvider``'s parts.

    Outside an inference engine the layer trains and scores as a grouped-GEMM ``MoELayer``; its checkpoint keys
    are those of ``get_moe_module_spec_for_backend(..., moe_grouped_gemm=True)``.
    """
    backend = InferenceSpecProvider()
    experts = backend.grouped_mlp_modules(True)  # InferenceGroupedMLP
    shared = ModuleSpec(module=SharedExpertMLP, submodules=MLPSubmodules(
        linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear(),
        activation_func=backend.activation_func()))
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(
        experts=experts, shared_experts=shared, router=InferenceTopKRouter))
