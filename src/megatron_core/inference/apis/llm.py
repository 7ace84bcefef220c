"""Synchronous high-level API (Megatron-Core's ``apis.llm.MegatronLLM``)."""

from __future__ import annotations

from typing import Any

from megatron_core.inference.apis._llm_base import Prompts, _MegatronLLMBase
from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.inference_request import DynamicInferenceRequest
from megatron_core.inference.sampling_params import SamplingParams

__all__ = ["MegatronLLM"]


class MegatronLLM(_MegatronLLMBase):
    """``MegatronLLM(model=..., tokenizer=..., inference_config=...).generate(prompts, sampling_params)``.

    ``generate`` always returns a list of finished :class:`DynamicInferenceRequest` in input order
    (one element for a single prompt), as in Megatron-Core.
    """

    def __init__(
        self, *, model: Any, tokenizer: Any, inference_config: InferenceConfig | None = None,
        use_coordinator: bool = True, coordinator_host: str | None = None, coordinator_port: int | None = None,
    ) -> None:
        super().__init__(
            model=model, tokenizer=tokenizer, inference_config=inference_config, use_coordinator=use_coordinator,
            coordinator_host=coordinator_host, coordinator_port=coordinator_port,
        )

    def generate(self, prompts: Prompts, sampling_params: SamplingParams | None = None) -> list[DynamicInferenceRequest]:
        """Generate for one prompt or a batch (continuous batching underneath)."""
        if self._shutdown_called:
            raise RuntimeError("MegatronLLM.generate called after shutdown()")
        normalized, _ = self._normalize_prompts(prompts)
        if not normalized:
            return []
        records = self._engine.generate(normalized, sampling_params or SamplingParams())
        return [r.merge() for r in records]

    def shutdown(self) -> None:
        """Free the KV cache (its memory too); later ``generate`` calls fail. Idempotent."""
        if not self._shutdown_called:
            self._shutdown_called = True
            self._engine.reset()
            self._context.kv_memory.clear()

    def __enter__(self) -> MegatronLLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
