"""``get_megatron_muon_optimizer``: Megatron-Core 0.19's deprecated entry point for Muon, kept for old callers.

Everything is built by :func:`~megatron_core.optimizer.get_megatron_optimizer` with ``optimizer="muon"``; the
layer-wise flag of the earlier signature (``layer_wise_distributed_optimizer=True``) is only accepted together with
``optimizer="dist_muon"``, the deprecated spelling of Muon with the layer-wise distributed optimizer.
"""

from __future__ import annotations

from typing import Any

from megatron_core.optimizer import get_megatron_optimizer
from megatron_core.optimizer.megatron_optimizer import MegatronOptimizer

__all__ = ["get_megatron_muon_optimizer"]


def get_megatron_muon_optimizer(*args: Any, **kwargs: Any) -> MegatronOptimizer:
    """Deprecated: call :func:`~megatron_core.optimizer.get_megatron_optimizer` with the same arguments."""
    layer_wise = kwargs.pop("layer_wise_distributed_optimizer", False)
    config = kwargs["config"] if "config" in kwargs else args[0]
    if layer_wise and not config.optimizer.startswith("dist_"):
        raise ValueError(f"layer_wise_distributed_optimizer=True needs optimizer='dist_muon' (got "
                         f"{config.optimizer!r}); or set OptimizerConfig.use_layer_wise_distributed_optimizer=True")
    return get_megatron_optimizer(*args, **kwargs)
