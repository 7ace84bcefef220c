"""Typing protocols of an MoE layer's slots (Megatron-Core 0.19's ``*Builder`` / ``*Interface`` classes).

The routed experts, shared experts and router of ``MoELayer`` (re-exported by ``moe.moe_layer``) and the
grouped fc1 / fc2 linears of ``TEGroupedMLP`` (re-exported by ``moe.experts``). Static-typing aids only, as in
Megatron-Core (not ``runtime_checkable``); ``tests/transformer/test_submodule_protocols.py`` checks that this
library's modules accept the calls they describe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from megatron_core.process_groups_config import ProcessGroupCollection
    from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = [
    "ExpertsBuilder", "ExpertsInterface", "GroupedLinearFc1Builder", "GroupedLinearFc1Interface",
    "GroupedLinearFc2Builder", "GroupedLinearFc2Interface", "RouterBuilder", "RouterInterface",
    "SharedExpertsBuilder", "SharedExpertsInterface",
]


class ExpertsInterface(Protocol):
    """The routed experts: dispatched tokens in, ``(output, bias or None)`` out."""

    def forward(self, dispatched_input: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's ``p * expert(x)``."""
        ...

    def backward_dw(self) -> None:
        """Run the deferred weight-gradient GEMMs."""
        ...


class ExpertsBuilder(Protocol):
    """Builds the routed experts."""

    def __call__(self, num_local_experts: int, config: TransformerConfig, /, *,
                 pg_collection: ProcessGroupCollection | None, name: str | None = None) -> ExpertsInterface:
        """The experts module."""
        ...


class SharedExpertsInterface(Protocol):
    """The shared experts, run on every token."""

    def forward(self, hidden_states: torch.Tensor, /) -> torch.Tensor:
        """The shared experts' output ``[s, b, h]``."""
        ...

    def backward_dw(self) -> None:
        """Run the deferred weight-gradient GEMMs."""
        ...


class SharedExpertsBuilder(Protocol):
    """Builds the shared experts."""

    def __call__(self, *, config: TransformerConfig, pg_collection: ProcessGroupCollection | None, gate: bool,
                 name: str | None = None) -> SharedExpertsInterface:
        """The shared experts module."""
        ...


class RouterInterface(Protocol):
    """The gate: ``(probs, routing_map)`` per token."""

    def forward(self, input: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probabilities, routing map)``."""
        ...

    def set_layer_number(self, layer_number: int) -> None:
        """The global layer number (set by the transformer layer when it builds the MoE layer)."""
        ...


class RouterBuilder(Protocol):
    """Builds the router."""

    def __call__(self, /, *, config: TransformerConfig,
                 pg_collection: ProcessGroupCollection | None) -> RouterInterface:
        """The router module."""
        ...


class GroupedLinearFc1Interface(Protocol):
    """The grouped first projection of all local experts."""

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: list[int], /
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(projected rows, bias or None)``."""
        ...

    def backward_dw(self) -> None:
        """Run the deferred weight-gradient GEMM."""
        ...


class GroupedLinearFc1Builder(Protocol):
    """Builds the grouped ``linear_fc1``."""

    def __call__(self, num_local_experts: int, input_size: int, output_size: int, /, *, config: TransformerConfig,
                 init_method: Callable[[torch.Tensor], None], bias: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name: str | None, pg_collection: ProcessGroupCollection | None,
                 name: str | None = None) -> GroupedLinearFc1Interface:
        """The grouped linear module."""
        ...


class GroupedLinearFc2Interface(Protocol):
    """The grouped second projection of all local experts."""

    def forward(self, intermediate_parallel: torch.Tensor, tokens_per_expert: list[int], /
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(projected rows, bias or None)``."""
        ...

    def backward_dw(self) -> None:
        """Run the deferred weight-gradient GEMM."""
        ...


class GroupedLinearFc2Builder(Protocol):
    """Builds the grouped ``linear_fc2``."""

    def __call__(self, num_local_experts: int, input_size: int, output_size: int, /, *, config: TransformerConfig,
                 init_method: Callable[[torch.Tensor], None], bias: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name: str | None, pg_collection: ProcessGroupCollection | None,
                 name: str | None = None) -> GroupedLinearFc2Interface:
        """The grouped linear module."""
        ...
