"""The batch API (Megatron-Core's ``engines.static_engine.StaticInferenceEngine``).

As in Megatron-Core 0.19, the static engine is a thin front over the dynamic engine: it takes a
controller whose wrapper holds a :class:`StaticInferenceContext` (for its ``max_batch_size`` and
``max_sequence_length``), builds a :class:`DynamicInferenceContext` of those sizes, and serves a
list of prompts to completion, returning :class:`InferenceRequest`-compatible results in order.
"""

from __future__ import annotations

import itertools
from typing import Any

from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_core.inference.contexts.static_context import StaticInferenceContext
from megatron_core.inference.engines.abstract_engine import AbstractEngine
from megatron_core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron_core.inference.inference_request import InferenceRequest
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

__all__ = ["StaticInferenceEngine"]


class StaticInferenceEngine(AbstractEngine):
    """Serve a batch of prompts with at most ``max_batch_size`` in flight."""

    def __init__(
        self, text_generation_controller: TextGenerationController, max_batch_size: int | None = None,
        random_seed: int | None = None, legacy: bool = False, buffer_size_gb: float | None = 40,
    ) -> None:
        if legacy:
            raise ValueError("StaticInferenceEngine(legacy=True) is not supported; the dynamic engine serves batches")
        self.controller = text_generation_controller
        self.inference_wrapped_model = text_generation_controller.inference_wrapped_model
        original = self.inference_wrapped_model.inference_context
        if not isinstance(original, StaticInferenceContext):
            raise ValueError(
                "StaticInferenceEngine needs the wrapper's inference_context to be a StaticInferenceContext, got "
                f"{type(original).__name__}"
            )
        if max_batch_size is None or max_batch_size > original.max_batch_size:
            max_batch_size = original.max_batch_size
        self.max_batch_size = max_batch_size
        self.random_seed = random_seed or 1234
        self.controller.reset_sampling_seed(self.random_seed)
        context = DynamicInferenceContext(
            self.inference_wrapped_model.config,
            InferenceConfig(
                max_sequence_length=original.max_sequence_length, buffer_size_gb=buffer_size_gb or 40,
                max_requests=max_batch_size, block_size_tokens=64, enable_chunked_prefill=True,
            ),
        )
        self.dynamic_engine = DynamicInferenceEngine(self.controller, context)
        self._ids = itertools.count()

    def get_new_request_id(self) -> str:
        """A fresh request id."""
        return str(next(self._ids))

    def generate(
        self, prompts: list[str] | None = None, add_BOS: bool = False, encoder_prompts: list[str] | None = None,
        common_inference_params: SamplingParams | None = None, sampling_params: SamplingParams | None = None,
        inference_requests: list[InferenceRequest] | None = None,
    ) -> list[InferenceRequest]:
        """Generate for ``prompts`` (or ``inference_requests``); results in input order."""
        if encoder_prompts is not None:
            raise ValueError("StaticInferenceEngine.generate: encoder_prompts (encoder-decoder models) are not supported")
        params = sampling_params or common_inference_params or SamplingParams()
        if add_BOS:
            params.add_BOS = True
        jobs: list[tuple[Any, SamplingParams]] = []
        if inference_requests is not None:
            jobs = [(r.prompt_tokens if r.prompt_tokens is not None else r.prompt, r.sampling_params or params)
                    for r in inference_requests]
        elif prompts is not None:
            jobs = [(p, params) for p in prompts]
        else:
            raise ValueError("StaticInferenceEngine.generate needs prompts or inference_requests")
        engine = self.dynamic_engine
        futures = [engine.add_request(self.get_new_request_id(), p, sp) for p, sp in jobs]
        while not all(f.done() for f in futures):
            engine.step_modern()
        return [f.result() for f in futures]
