"""The vision-language (LLaVA) inference wrapper."""

from megatron_core.inference.model_inference_wrappers.multimodal.vlm_inference_wrapper import (
    VLMInferenceWrapper,
)

__all__ = ["VLMInferenceWrapper"]
