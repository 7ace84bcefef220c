"""Selective activation recompute of single modules: which ones are on, and the activation-only recompute.

``recompute_granularity="selective"`` with names in ``recompute_modules`` recomputes those parts in the backward
instead of keeping their activations. :class:`ActivationRecompute` serves ``"moe_act"``: the experts' activation
output (the largest activation of an MoE layer) is freed once the second projection has used it, and rebuilt
from the first projection's output just before the second projection's backward needs it
(:class:`~megatron_core.tensor_parallel.CheckpointWithoutOutput`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core.tensor_parallel.random import CheckpointWithoutOutput

__all__ = ["ActivationRecompute", "recompute_module_enabled"]


def recompute_module_enabled(config: Any, name: str) -> bool:
    """Whether ``config`` asks for selective recompute of the module ``name`` (``"moe_act"``, ``"mlp"``, ...)."""
    return config.recompute_granularity == "selective" and name in (config.recompute_modules or ())


class ActivationRecompute:
    """Run an activation, optionally without keeping its output: ``y = r.run(act, x)``, ``z = fc2(y)``,
    ``r.discard(z)``. Off (a plain call) when ``enabled`` is False or inside a compiled graph, where the freeing
    of ``y``'s storage cannot be traced."""

    def __init__(self, enabled: bool) -> None:
        self.checkpoint = CheckpointWithoutOutput() if enabled and not torch.compiler.is_compiling() else None

    def run(self, activation: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """``activation(*args)``; with recompute on, its activations are not kept."""
        if self.checkpoint is None:
            return activation(*args)
        return self.checkpoint.checkpoint(activation, *args)

    def discard(self, consumer_output: torch.Tensor) -> None:
        """Free the activation's output, to be rebuilt when ``consumer_output``'s gradient arrives."""
        if self.checkpoint is not None:
            self.checkpoint.discard_output_and_register_recompute(consumer_output)
