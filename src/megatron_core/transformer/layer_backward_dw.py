"""The attention slot's deferred weight gradients of a transformer layer (Megatron-Core's ``_BackwardDWWrapper``,
built by ``TransformerLayer.init_backward_dw_wrapper``).

With ``delay_wgrad_compute`` the combined 1F1B schedule calls ``backward_dw()`` of each layer slot after its
backward. The attention slot (``pre_dispatch_computation``) owns the attention's weight gradients and, in a MoE
layer, the shared experts' (they run in that slot); the routed experts' or the dense MLP's belong to the ``mlp``
slot (``layer.mlp.backward_dw``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megatron_core.tensor_parallel.delayed_wgrad import run_delayed_wgrads

__all__ = ["LayerBackwardDW"]


class LayerBackwardDW:
    """``backward_dw()`` of a transformer layer's attention slot; ``parameters()`` lists the weights it covers."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.modules: list[torch.nn.Module] = [layer.self_attention]
        shared = getattr(layer.mlp, "shared_experts", None)
        if shared is not None:
            self.modules.append(shared)

    def backward_dw(self) -> None:
        """Run the shared experts' then the attention's deferred weight-gradient GEMMs."""
        if self.layer is None:
            return
        mlp = self.layer.mlp
        if getattr(mlp, "shared_experts", None) is not None:
            mlp.backward_dw(routed_experts=False, shared_experts=True)
        attention = self.layer.self_attention
        if hasattr(attention, "backward_dw"):
            attention.backward_dw()
        else:  # an attention variant without the method (e.g. a linear-attention mixer): its linears directly
            run_delayed_wgrads(attention)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The parameters of the modules whose weight gradients this slot runs."""
        for module in self.modules:
            yield from module.parameters()
