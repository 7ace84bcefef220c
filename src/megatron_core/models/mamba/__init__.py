"""Hybrid Mamba language models at their pre-0.19 path (Megatron-Core's ``models.mamba``); the model
now lives in :mod:`megatron_core.models.hybrid`."""

from megatron_core.models.hybrid.hybrid_model import HybridModel
from megatron_core.models.mamba.mamba_model import MambaModel

__all__ = ["HybridModel", "MambaModel"]
