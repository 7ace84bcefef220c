"""Hybrid layer patterns at Megatron-Core's path ``ssm.mamba_hybrid_layer_allocation`` (before 0.19); the code lives in
:mod:`megatron_core._ground.hybrid_pattern` (pure string handling that the storage layer needs too)."""

from megatron_core._ground.hybrid_pattern import *  # noqa: F403
from megatron_core._ground.hybrid_pattern import __all__ as __all__
