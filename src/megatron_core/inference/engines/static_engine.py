"""The batch API (Megatron-Core's ``engines.static_engine.StaticInferenceEngine``).

As in Megatron-Core 0.19, the static engine is a thin front over the dynamic engine: it takes a
controller whose wrapper holds a :class:`StaticInferenceContext` (for its ``max_batch_size`` and
``max_sequence_length``), builds a :class:`DynamicInferenceContext` of those sizes, and serves a
list of prompts to completion, returning :class:`InferenceRequest`-compatible results in order (a hybrid
model's Mamba state slots are sized from the model: :meth:`MambaInferenceStateConfig.from_model`).
With ``legacy=True``, and always for encoder-decoder and vision-language controllers, batches of at
most ``max_batch_size`` requests run through the controller's static-batch loop instead
(``generate_all_output_tokens_static_batch``), as Megatron-Core's legacy static engine does; that loop's
:class:`StaticInferenceContext` has no Mamba states, so hybrid models need ``legacy=False``.
"""

from __future__ import annotations

import collections
from typing import Any

from megatron_core.inference.config import InferenceConfig, MambaInferenceStateConfig
from megatron_core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_core.inference.contexts.static_context import StaticInferenceContext
from megatron_core.inference.engines.abstract_engine import AbstractEngine
from megatron_core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron_core.inference.inference_request import InferenceRequest
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers.encoder_decoder_text_generation_controller import (
    EncoderDecoderTextGenerationController,
)
from megatron_core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from megatron_core.inference.text_generation_controllers.vlm_text_generation_controller import (
    VLMTextGenerationController,
)
from megatron_core.inference.utils import Counter, InferenceMode

__all__ = ["StaticInferenceEngine"]


class StaticInferenceEngine(AbstractEngine):
    """Serve a batch of prompts with at most ``max_batch_size`` in flight."""

    def __init__(
        self, text_generation_controller: TextGenerationController, max_batch_size: int | None = None,
        random_seed: int | None = None, legacy: bool = False, buffer_size_gb: float | None = 40,
    ) -> None:
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
        self._ids = Counter()
        InferenceMode.set_active()
        # Encoder-decoder and VLM models run only in the static-batch loop (as in Megatron-Core).
        self.legacy = legacy or isinstance(
            text_generation_controller, (EncoderDecoderTextGenerationController, VLMTextGenerationController))
        if self.legacy:
            return
        context = DynamicInferenceContext(
            self.inference_wrapped_model.config,
            InferenceConfig(
                max_sequence_length=original.max_sequence_length, buffer_size_gb=buffer_size_gb or 40,
                max_requests=max_batch_size, block_size_tokens=64, enable_chunked_prefill=True,
                mamba_inference_state_config=MambaInferenceStateConfig.from_model(self.inference_wrapped_model.model),
            ),
        )
        self.dynamic_engine = DynamicInferenceEngine(self.controller, context)

    def get_new_request_id(self) -> str:
        """A fresh request id."""
        return str(next(self._ids))

    def generate(
        self, prompts: list[str] | None = None, add_BOS: bool = False, encoder_prompts: list[str] | None = None,
        common_inference_params: SamplingParams | None = None, sampling_params: SamplingParams | None = None,
        inference_requests: list[InferenceRequest] | None = None,
    ) -> list[InferenceRequest]:
        """Generate for ``prompts`` (or ``inference_requests``); results in input order."""
        if encoder_prompts is not None and not isinstance(self.controller, EncoderDecoderTextGenerationController):
            raise ValueError("StaticInferenceEngine.generate: encoder_prompts need an "
                             f"EncoderDecoderTextGenerationController, got {type(self.controller).__name__}")
        params = sampling_params or common_inference_params or SamplingParams()
        if add_BOS:
            params.add_BOS = True
        if self.legacy:
            return self._generate_static_batches(prompts, encoder_prompts, params, inference_requests)
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

    def _generate_static_batches(
        self, prompts: list[str] | None, encoder_prompts: list[str] | None, params: SamplingParams,
        inference_requests: list[InferenceRequest] | None,
    ) -> list[InferenceRequest]:
        """Serve the requests in batches of ``max_batch_size`` with the controller's static-batch loop."""
        if inference_requests is None:
            if prompts is None:
                raise ValueError("StaticInferenceEngine.generate needs prompts or inference_requests")
            if encoder_prompts is not None and len(encoder_prompts) != len(prompts):
                raise ValueError(f"StaticInferenceEngine.generate: {len(prompts)} prompts but {len(encoder_prompts)} "
                                 "encoder_prompts")
            inference_requests = [
                InferenceRequest(request_id=self.get_new_request_id(), sampling_params=params,
                                 prompt=prompt if isinstance(prompt, str) else None,
                                 prompt_tokens=None if isinstance(prompt, str) else [int(t) for t in prompt],
                                 encoder_prompt=None if encoder_prompts is None else encoder_prompts[i])
                for i, prompt in enumerate(prompts)
            ]
        for request in inference_requests:
            if request.prompt_tokens is None:
                request.prompt_tokens = self.controller.tokenize_prompt(
                    self.controller.tokenizer, request.prompt, request.sampling_params.add_BOS)
                request.prompt_length = len(request.prompt_tokens)
        for first in range(0, len(inference_requests), self.max_batch_size):
            batch = inference_requests[first : first + self.max_batch_size]
            self.controller.generate_all_output_tokens_static_batch(
                collections.OrderedDict((r.request_id, r) for r in batch))
        return list(inference_requests)
