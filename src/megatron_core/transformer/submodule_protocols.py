"""Typing protocols of the layer slots a spec fills (Megatron-Core 0.19's ``*Builder`` / ``*Interface`` classes).

A ``*Builder`` describes the call that builds a slot (a module class or a ``functools.partial`` of one, called
with these arguments), a ``*Interface`` the module it returns. They are static-typing aids only, as in
Megatron-Core: not ``runtime_checkable``, so ``isinstance`` does not apply; ``tests/transformer/
test_submodule_protocols.py`` checks that this library's modules accept the calls. Megatron-Core's modules
re-export them: ``transformer_layer`` (MLP slot), ``attention`` (QKV, Q / KV, core attention and output
projections) and ``mlp`` (fc1, fc2, activation). The MoE slots' protocols are in ``moe.submodule_protocols``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from megatron_core.packed_seq_params import PackedSeqParams
    from megatron_core.process_groups_config import ProcessGroupCollection
    from megatron_core.transformer.enums import AttnMaskType
    from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = [
    "CoreAttentionBuilder", "CoreAttentionInterface", "LinearFc1Builder", "LinearFc1Interface", "LinearFc2Builder",
    "LinearFc2Interface", "LinearInterface", "LinearLayerBuilder", "LinearProjBuilder", "LinearProjInterface",
    "LinearQkvBuilder", "LinearQkvInterface", "MlpBuilder", "MlpInterface", "TEActivationFunctionBuilder",
    "TEActivationFunctionInterface",
]


class MlpInterface(Protocol):
    """A transformer layer's MLP slot (a dense ``MLP`` or an ``MoELayer``)."""

    def forward(self, hidden_states: Tensor, /, *, intermediate_tensors: tuple[Tensor, ...] | None = None,
                padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """``(output [s, b, h], bias or None)``."""
        ...


class MlpBuilder(Protocol):
    """Builds a transformer layer's MLP slot."""

    def __call__(self, *, config: TransformerConfig, pg_collection: ProcessGroupCollection, is_mtp_layer: bool,
                 name: str | None = None) -> MlpInterface:
        """The MLP module."""
        ...


class LinearQkvInterface(Protocol):
    """The fused query / key / value projection of an attention layer."""

    def forward(self, input: Tensor, /) -> tuple[Tensor, object]:
        """``(projected, bias or None)``."""
        ...

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMM deferred by ``delay_wgrad_compute``."""
        ...


class LinearQkvBuilder(Protocol):
    """Builds ``linear_qkv``."""

    def __call__(self, input_size: int, output_size: int, /, *, config: TransformerConfig,
                 init_method: Callable[[torch.Tensor], None], gather_output: bool, bias: bool, skip_bias_add: bool,
                 is_expert: bool, tp_comm_buffer_name: str,
                 tp_group: torch.distributed.ProcessGroup | None = None) -> LinearQkvInterface:
        """The projection module."""
        ...


class LinearInterface(Protocol):
    """A separate query (``linear_q``) or key-value (``linear_kv``) projection."""

    def forward(self, input: Tensor, /) -> tuple[Tensor, object]:
        """``(projected, bias or None)``."""
        ...


class LinearLayerBuilder(Protocol):
    """Builds ``linear_q`` / ``linear_kv``."""

    def __call__(self, input_size: int, output_size: int, /, *, config: TransformerConfig,
                 init_method: Callable[[torch.Tensor], None], gather_output: bool, bias: bool, skip_bias_add: bool,
                 is_expert: bool) -> LinearInterface:
        """The projection module."""
        ...


class CoreAttentionInterface(Protocol):
    """The attention kernel between the projections (``DotProductAttention`` and its peers)."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, /, *,
                attn_mask_type: AttnMaskType, attention_bias: Tensor | None,
                packed_seq_params: PackedSeqParams | None) -> Tensor:
        """The attention output ``[s, b, heads * head_dim]``."""
        ...


class CoreAttentionBuilder(Protocol):
    """Builds ``core_attention``."""

    def __call__(self, *, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, cp_comm_type: str | None, softmax_scale: float | None,
                 pg_collection: ProcessGroupCollection | None) -> CoreAttentionInterface:
        """The core attention module."""
        ...


class LinearProjInterface(Protocol):
    """The output projection of an attention layer."""

    def forward(self, hidden_states: Tensor, /) -> tuple[Tensor, Tensor | None]:
        """``(projected, bias or None)``."""
        ...

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMM deferred by ``delay_wgrad_compute``."""
        ...


class LinearProjBuilder(Protocol):
    """Builds ``linear_proj``."""

    def __call__(self, query_projection_size: int, hidden_size: int, /, *, config: TransformerConfig,
                 init_method: Callable[[torch.Tensor], None], bias: bool, input_is_parallel: bool,
                 skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: str,
                 tp_group: torch.distributed.ProcessGroup | None) -> LinearProjInterface:
        """The projection module."""
        ...


class LinearFc1Interface(Protocol):
    """An MLP's first projection."""

    def forward(self, hidden_states: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(projected, bias or None)``."""
        ...

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMM deferred by ``delay_wgrad_compute``."""
        ...


class LinearFc1Builder(Protocol):
    """Builds an MLP's ``linear_fc1``."""

    def __call__(self, input_size: int, output_size: int, /, *, config: TransformerConfig,
                 init_method: Callable[[torch.Tensor], None], gather_output: bool, bias: bool, skip_bias_add: bool,
                 is_expert: bool, tp_comm_buffer_name: str | None, tp_group: torch.distributed.ProcessGroup | None,
                 stride: int = 1, name: str | None = None) -> LinearFc1Interface:
        """The projection module."""
        ...


class TEActivationFunctionInterface(Protocol):
    """An MLP's activation module (Transformer Engine's fused activations in Megatron-Core)."""

    def forward(self, input_: torch.Tensor, /) -> torch.Tensor:
        """The activated tensor."""
        ...


class TEActivationFunctionBuilder(Protocol):
    """Builds an MLP's ``activation_func`` module."""

    def __call__(self, *, config: TransformerConfig) -> TEActivationFunctionInterface:
        """The activation module."""
        ...


class LinearFc2Interface(Protocol):
    """An MLP's second projection."""

    def forward(self, hidden_states: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(projected, bias or None)``."""
        ...

    def backward_dw(self) -> None:
        """Run the weight-gradient GEMM deferred by ``delay_wgrad_compute``."""
        ...


class LinearFc2Builder(Protocol):
    """Builds an MLP's ``linear_fc2``."""

    def __call__(self, input_size: int, output_size: int, /, *, config: TransformerConfig,
                 init_method: Callable[[torch.Tensor], None], bias: bool, input_is_parallel: bool,
                 skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: str | None,
                 tp_group: torch.distributed.ProcessGroup | None, name: str | None = None) -> LinearFc2Interface:
        """The projection module."""
        ...
