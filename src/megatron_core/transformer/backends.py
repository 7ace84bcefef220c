"""Backend spec providers: which classes fill the linear, norm and attention slots of a layer spec.

Megatron-Core's ``BackendSpecProvider`` protocol. Spec functions ask a provider for each part,
so a different attention kernel or fused norm is chosen by passing another provider (or a
subclass of :class:`LocalSpecProvider` overriding one method), never by editing model code::

    class FlashProvider(LocalSpecProvider):
        def core_attention(self):
            return MyFlashAttention          # same constructor/forward as DotProductAttention

    spec = get_gpt_layer_local_spec(backend=FlashProvider())

Megatron-Core keeps this in ``models/backends.py`` (re-exported there); the providers hand out
transformer building blocks, so they live in the transformer layer, where multi-token prediction
and every model's specs can reach them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from megatron_core import tensor_parallel
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.mlp import MLPSubmodules
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.torch_norm import WrappedTorchNorm

__all__ = ["INPUT_NORM_KEY", "PRE_MLP_NORM_KEY", "BackendSpecProvider", "LocalSpecProvider", "experts_spec",
           "fused_norm_keys_map", "te_spec_provider"]

# Checkpoint names of the separate local norms: Transformer Engine fuses each norm into the next linear layer,
# and Megatron-Core's checkpoints store it there, so a local layer maps its norm keys onto those names.
INPUT_NORM_KEY = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
PRE_MLP_NORM_KEY = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def fused_norm_keys_map(attention: bool = True, mlp: bool = True) -> dict[str, str]:
    """``sharded_state_dict_keys_map`` of a local layer whose norms a TE layer would fuse (a fresh dict)."""
    return {**(INPUT_NORM_KEY if attention else {}), **(PRE_MLP_NORM_KEY if mlp else {})}


class BackendSpecProvider(Protocol):
    """What a backend must name for the spec functions."""

    def column_parallel_linear(self) -> type:
        """Class for column-parallel linear layers."""

    def row_parallel_linear(self) -> type:
        """Class for row-parallel linear layers."""

    def fuse_layernorm_and_linear(self) -> bool:
        """True when the backend fuses the pre-norm into the following linear layer."""

    def column_parallel_layer_norm_linear(self) -> type | None:
        """Class for a fused norm + column-parallel linear (when fused)."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        """Class for a norm (``rms_norm`` forces RMSNorm; ``for_qk`` is the per-head q/k norm)."""

    def core_attention(self) -> type:
        """Class for core attention (``DotProductAttention``'s interface)."""

    def activation_func(self) -> Callable | None:
        """An activation override for the MLP, or None to use ``config.activation_func``."""

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool) -> Any:
        """Expert MLP modules (MoE)."""


class LocalSpecProvider:
    """Pure PyTorch + this library's tensor-parallel layers (no optional dependencies)."""

    def column_parallel_linear(self) -> type:
        """``tensor_parallel.ColumnParallelLinear``."""
        return tensor_parallel.ColumnParallelLinear

    def row_parallel_linear(self) -> type:
        """``tensor_parallel.RowParallelLinear``."""
        return tensor_parallel.RowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        """Local layers keep the norm separate."""
        return False

    def column_parallel_layer_norm_linear(self) -> type | None:
        """No fused norm + linear locally."""
        return None

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        """``WrappedTorchNorm`` (LayerNorm or RMSNorm from ``config.normalization``)."""
        return WrappedTorchNorm

    def core_attention(self) -> type:
        """``DotProductAttention`` on ``F.scaled_dot_product_attention``."""
        return DotProductAttention

    def activation_func(self) -> Callable | None:
        """Use ``config.activation_func``."""
        return None

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool) -> Any:
        """Routed experts: ``TEGroupedMLP`` on grouped linears (one GEMM per projection) or ``SequentialMLP``."""
        from megatron_core.transformer.moe import grouped_linear

        return experts_spec(
            moe_use_grouped_gemm, (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear),
            (grouped_linear.ColumnParallelGroupedLinear, grouped_linear.RowParallelGroupedLinear))


def experts_spec(moe_use_grouped_gemm: bool, linears: tuple[type, type], grouped_linears: tuple[type, type]
                 ) -> ModuleSpec:
    """A provider's routed experts: ``TEGroupedMLP`` on ``grouped_linears`` (fc1, fc2) with ``moe_use_grouped_gemm``,
    else ``SequentialMLP`` on ``linears`` (fc1, fc2)."""
    from megatron_core.transformer.moe import experts

    if moe_use_grouped_gemm:
        return ModuleSpec(module=experts.TEGroupedMLP, submodules=experts.GroupedMLPSubmodules(
            linear_fc1=grouped_linears[0], linear_fc2=grouped_linears[1]))
    return ModuleSpec(module=experts.SequentialMLP, submodules=MLPSubmodules(
        linear_fc1=linears[0], linear_fc2=linears[1]))


def te_spec_provider() -> BackendSpecProvider:
    """Transformer Engine's spec provider: ``ImportError`` naming the ``te`` extra when TE is not installed."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "the Transformer Engine layer spec needs Transformer Engine, which is not installed: "
            "pip install megatron_core[te] (or build the model with get_gpt_layer_local_spec())"
        ) from err
    raise NotImplementedError(
        "Transformer Engine is installed, but megatron_core provides no Transformer Engine layers yet; "
        "use get_gpt_layer_local_spec() (docs/compat.md)"
    )
