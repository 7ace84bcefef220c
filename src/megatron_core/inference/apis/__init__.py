"""High-level inference API: ``MegatronLLM``, ``MegatronAsyncLLM``, ``ServeConfig``."""

from megatron_core.inference.apis.async_llm import MegatronAsyncLLM
from megatron_core.inference.apis.llm import MegatronLLM
from megatron_core.inference.apis.serve_config import ServeConfig
from megatron_core.inference.inference_request import DynamicInferenceRequest, DynamicInferenceRequestRecord
from megatron_core.inference.sampling_params import SamplingParams

__all__ = [
    "DynamicInferenceRequest",
    "DynamicInferenceRequestRecord",
    "MegatronAsyncLLM",
    "MegatronLLM",
    "SamplingParams",
    "ServeConfig",
]
