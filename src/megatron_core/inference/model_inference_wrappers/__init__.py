"""Adapters that run one model forward for the inference engines."""

from megatron_core.inference.model_inference_wrappers.abstract_model_inference_wrapper import (
    AbstractModelInferenceWrapper,
)

__all__ = ["AbstractModelInferenceWrapper"]
