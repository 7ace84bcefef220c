"""Inference engines: dynamic (continuous batching) and static (batch API)."""

from megatron_core.inference.engines.abstract_engine import AbstractEngine
from megatron_core.inference.engines.dynamic_engine import (
    DynamicInferenceEngine,
    EngineState,
    EngineSuspendedError,
)
from megatron_core.inference.engines.static_engine import StaticInferenceEngine

__all__ = ["AbstractEngine", "DynamicInferenceEngine", "EngineState", "EngineSuspendedError", "StaticInferenceEngine"]
