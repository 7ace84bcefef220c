"""``get_attr_wrapped_model`` and ``get_model_config`` at their former path; they live in ``megatron_core.utils``."""

from megatron_core._wrapped_model import get_attr_wrapped_model, get_model_config

__all__ = ["get_attr_wrapped_model", "get_model_config"]
