"""``get_model`` and ``configure_model_hooks`` at their former path; the code lives in
:mod:`megatron_core.training.model_builder` (the training-loop layer)."""

from megatron_core.training.model_builder import configure_model_hooks, get_model

__all__ = ["configure_model_hooks", "get_model"]
