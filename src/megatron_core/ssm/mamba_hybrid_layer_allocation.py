"""Hybrid layer patterns at their pre-0.19 path; the code lives in
:mod:`megatron_core.models.hybrid.hybrid_layer_allocation` (Megatron-Core 0.19 moved it there)."""

from megatron_core.models.hybrid.hybrid_layer_allocation import *  # noqa: F403
from megatron_core.models.hybrid.hybrid_layer_allocation import __all__ as __all__
