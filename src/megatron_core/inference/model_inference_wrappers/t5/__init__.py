"""The T5 (encoder-decoder) inference wrapper."""

from megatron_core.inference.model_inference_wrappers.t5.t5_inference_wrapper import T5InferenceWrapper

__all__ = ["T5InferenceWrapper"]
