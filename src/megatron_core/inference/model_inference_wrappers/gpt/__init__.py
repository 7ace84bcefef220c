"""The GPT inference wrapper."""

from megatron_core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

__all__ = ["GPTInferenceWrapper"]
