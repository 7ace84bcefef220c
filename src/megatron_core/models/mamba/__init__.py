"""Hybrid Mamba language models (Megatron-Core's ``models.mamba``)."""

from megatron_core.models.mamba.mamba_model import MambaModel

__all__ = ["MambaModel"]
