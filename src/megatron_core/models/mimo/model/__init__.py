"""The MIMO model."""

from megatron_core.models.mimo.model.base import MimoModel

__all__ = ["MimoModel"]
