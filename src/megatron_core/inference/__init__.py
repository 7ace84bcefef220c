"""Inference for Megatron-Core models (Megatron-Core's ``megatron.core.inference``) on plain PyTorch.

A paged KV cache with continuous batching (:mod:`.contexts`, :mod:`.engines`), sampling
(:mod:`.sampling`), the model wrapper and generation controller, the high-level
``MegatronLLM`` / ``MegatronAsyncLLM`` (:mod:`.apis`) and an OpenAI-compatible HTTP server
(:mod:`.text_generation_server`, needs the ``server`` extra). Runs on CPU and GPU.
"""

from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.inference_request import (
    DynamicInferenceRequest,
    DynamicInferenceRequestRecord,
    InferenceRequest,
    Status,
)
from megatron_core.inference.sampling_params import SamplingParams

__all__ = [
    "DynamicInferenceRequest",
    "DynamicInferenceRequestRecord",
    "InferenceConfig",
    "InferenceRequest",
    "SamplingParams",
    "Status",
]
