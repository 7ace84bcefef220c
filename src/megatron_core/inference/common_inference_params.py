"""Deprecated alias: ``CommonInferenceParams`` is :class:`SamplingParams` (as in Megatron-Core)."""

from megatron_core.inference.sampling_params import SamplingParams

CommonInferenceParams = SamplingParams

__all__ = ["CommonInferenceParams"]
