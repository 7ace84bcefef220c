"""Backend spec providers at Megatron-Core's path, and ``get_backend`` choosing one by ``transformer_impl``.

``BackendSpecProvider`` and ``LocalSpecProvider`` live in :mod:`megatron_core.transformer.backends`
(the transformer layer's specs use them); ``TESpecProvider`` in
:mod:`megatron_core.extensions.transformer_engine_spec_provider`.

:class:`InferenceSpecProvider` is the provider of ``transformer_impl="inference_optimized"``. Megatron-Core
fills its slots with Transformer Engine based inference layers (symmetric-memory collectives, MXFP8 GEMMs);
here, as in :func:`~megatron_core.models.gpt.gpt_layer_specs.get_gpt_layer_with_inference_spec`, the same
computation runs on the local layers, whose separate norms the spec functions store under the fused
modules' checkpoint names, so checkpoints interchange.
"""

from __future__ import annotations

from typing import Any, Literal

from megatron_core import tensor_parallel
from megatron_core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron_core.tensor_parallel.duplicated_linear import DuplicatedLinear
from megatron_core.transformer.backends import BackendSpecProvider, LocalSpecProvider, experts_spec

__all__ = ["BackendSpecProvider", "InferenceSpecProvider", "LocalSpecProvider", "get_backend"]


class InferenceSpecProvider(LocalSpecProvider):
    """The ``inference_optimized`` backend: the local layers in every slot (see the module docstring).

    It differs from :class:`LocalSpecProvider` where Megatron-Core's does: it names a replicated
    :meth:`linear` and always builds the routed experts on grouped linears.
    """

    def linear(self) -> type:
        """A linear layer held whole on every tensor-parallel rank: ``DuplicatedLinear``."""
        return DuplicatedLinear

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool) -> Any:
        """Routed experts as ``InferenceGroupedMLP`` on grouped linears (one GEMM per projection), whatever
        ``moe_use_grouped_gemm`` says, as Megatron-Core's provider: it trains as ``TEGroupedMLP`` (same keys) and
        takes dense top-k routing under an inference engine."""
        from megatron_core.transformer.moe import experts, grouped_linear

        spec = experts_spec(
            True, (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear),
            (grouped_linear.ColumnParallelGroupedLinear, grouped_linear.RowParallelGroupedLinear))
        spec.module = experts.InferenceGroupedMLP
        return spec


def get_backend(transformer_impl: Literal["local", "transformer_engine", "inference_optimized"]
                ) -> BackendSpecProvider:
    """The spec provider of ``transformer_impl``; ``ValueError`` for any other value."""
    if transformer_impl == "transformer_engine":
        return TESpecProvider()
    if transformer_impl == "inference_optimized":
        return InferenceSpecProvider()
    if transformer_impl == "local":
        return LocalSpecProvider()
    raise ValueError(f"unknown transformer_impl={transformer_impl!r}: expected 'local', 'transformer_engine' "
                     "or 'inference_optimized'")
