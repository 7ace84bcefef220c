"""Hybrid layer specs at their pre-0.19 path; the code lives in
:mod:`megatron_core.models.hybrid.hybrid_layer_specs` (Megatron-Core 0.19 moved it there)."""

from megatron_core.models.hybrid.hybrid_layer_specs import *  # noqa: F403
from megatron_core.models.hybrid.hybrid_layer_specs import __all__ as __all__
