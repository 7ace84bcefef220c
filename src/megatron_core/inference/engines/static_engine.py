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

The older request-by-request surface works as in Megatron-Core: :meth:`~StaticInferenceEngine.add_request`
(optionally ``streaming=True``) puts a request in the :class:`~megatron_core.inference.scheduler.Scheduler`,
:meth:`~StaticInferenceEngine.run_engine` (or ``await run_engine_async()``) serves the scheduler's batches of at
most ``max_batch_size`` until none is pending, and :meth:`~StaticInferenceEngine.get_stream_generator` yields a
streaming request's partial results as they are generated. The results land in
``scheduler.completed_request_pool``. With ``legacy=False`` each batch runs on the dynamic engine
(:mod:`._static_batch_on_dynamic`), where Megatron-Core would fail for want of a static context; there is no
progress bar (Megatron-Core's needs ``tqdm``).
"""

from __future__ import annotations

import asyncio
import warnings
from collections import OrderedDict
from collections.abc import AsyncGenerator
from typing import Any

import torch

from megatron_core._ground.async_utils import get_asyncio_loop
from megatron_core.inference.async_stream import AsyncStream
from megatron_core.inference.config import InferenceConfig, MambaInferenceStateConfig
from megatron_core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_core.inference.contexts.static_context import StaticInferenceContext
from megatron_core.inference.engines._static_batch_on_dynamic import generate_static_batch_on_dynamic_engine
from megatron_core.inference.engines.abstract_engine import AbstractEngine
from megatron_core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron_core.inference.inference_request import ENDED_STATUSES, InferenceRequest
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.scheduler import Scheduler
from megatron_core.inference.text_generation_controllers.encoder_decoder_text_generation_controller import (
    EncoderDecoderTextGenerationController,
)
from megatron_core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from megatron_core.inference.text_generation_controllers.vlm_text_generation_controller import (
    VLMTextGenerationController,
)
from megatron_core.inference.utils import InferenceMode

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
        self.scheduler = Scheduler(max_batch_size=max_batch_size)
        self.random_seed = random_seed or 1234
        self.controller.reset_sampling_seed(self.random_seed)
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

    def get_new_request_id(self) -> int:
        """A fresh request id (from the scheduler)."""
        return self.scheduler.get_new_request_id()

    # ---- request by request ---------------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int] | torch.Tensor | None = None, add_BOS: bool = False,
        encoder_prompt: str | None = None, sampling_params: SamplingParams | None = None, streaming: bool = False,
        inference_request: InferenceRequest | None = None, *, inference_parameters: SamplingParams | None = None,
    ) -> Any:
        """Tokenize ``prompt`` (text, or token ids as they are) and queue it, or queue ``inference_request``; its id.

        ``streaming=True`` opens the request's stream (see :meth:`get_stream_generator`); call it from inside the
        event loop that will read the stream. A BOS token is added when ``add_BOS`` or ``sampling_params.add_BOS``.
        """
        if prompt is None and inference_request is None:
            raise ValueError("StaticInferenceEngine.add_request needs a prompt or an inference_request")
        if encoder_prompt is not None and not isinstance(self.controller, EncoderDecoderTextGenerationController):
            raise ValueError("StaticInferenceEngine.add_request: an encoder_prompt needs an "
                             f"EncoderDecoderTextGenerationController, got {type(self.controller).__name__}")
        if inference_request is not None:
            if inference_request.prompt_tokens is None:
                if inference_request.prompt is None:
                    raise ValueError(f"StaticInferenceEngine.add_request: request {inference_request.request_id!r} "
                                     "has neither prompt nor prompt_tokens")
                inference_request.prompt_tokens = self._tokenize(
                    inference_request.prompt, add_BOS or inference_request.sampling_params.add_BOS)
                inference_request.prompt_length = len(inference_request.prompt_tokens)
            return self.scheduler.add_request(inference_request=inference_request, streaming=streaming)
        if sampling_params is None and inference_parameters is not None:
            warnings.warn("`inference_parameters` has been renamed to `sampling_params`", DeprecationWarning,
                          stacklevel=2)
            sampling_params = inference_parameters
        params = sampling_params if sampling_params is not None else SamplingParams()
        tokens = self._tokenize(prompt, add_BOS or params.add_BOS)
        return self.scheduler.add_request(prompt=prompt if isinstance(prompt, str) else None, prompt_tokens=tokens,
                                          encoder_prompt=encoder_prompt, sampling_params=params, streaming=streaming)

    def _tokenize(self, prompt: str | list[int] | torch.Tensor, add_BOS: bool) -> list[int]:
        """Token ids of a text prompt, or the ids of a token prompt."""
        if isinstance(prompt, str):
            return self.controller.tokenize_prompt(self.controller.tokenizer, prompt, add_BOS)
        if isinstance(prompt, torch.Tensor):
            return [int(t) for t in prompt.reshape(-1).tolist()]
        return [int(t) for t in prompt]

    def get_stream_generator(self, request_id: Any) -> AsyncGenerator[InferenceRequest, None] | None:
        """The async generator of a streaming request's partial results; ``None`` for a request added without one."""
        if request_id not in self.scheduler.requests:
            raise ValueError(f"StaticInferenceEngine.get_stream_generator: unknown request_id {request_id!r}")
        stream = self.scheduler.streams.get(request_id)
        return None if stream is None else stream.generator()

    def run_engine(self) -> None:
        """Serve the scheduler's batches (at most ``max_batch_size`` each, arrival order) until none is pending.

        A batch that raises fails its requests (status ``FAILED``, in the completed pool, their streams raise the
        error) and the error propagates; waiting requests stay queued for the next call.
        """
        scheduler = self.scheduler
        while scheduler.have_requests_pending():
            active: OrderedDict[Any, InferenceRequest] = scheduler.active_request_pool.copy()
            if not active:
                scheduler.update_requests_pools()
                continue
            streams: OrderedDict[Any, AsyncStream] = OrderedDict(
                (request_id, scheduler.streams[request_id]) for request_id in active if request_id in scheduler.streams)
            try:
                result = self._run_batch(active, streams)
                unfinished = [request_id for request_id, r in result.items() if r.status not in ENDED_STATUSES]
                if unfinished:
                    raise RuntimeError(f"the static batch returned without finishing requests {unfinished}")
            except BaseException as error:
                scheduler.fail_requests(list(active), error)
                raise
            scheduler.update_requests_pools(result_dict=result)

    def _run_batch(
        self, active_requests: OrderedDict[Any, InferenceRequest], active_streams: OrderedDict[Any, AsyncStream],
    ) -> OrderedDict[Any, InferenceRequest]:
        """Generate one batch to completion: the controller's static loop (legacy) or the dynamic engine."""
        if self.legacy:
            return self.controller.generate_all_output_tokens_static_batch(active_requests, active_streams)
        return generate_static_batch_on_dynamic_engine(self.dynamic_engine, active_requests, active_streams)

    def _wrapped_run_engine(self, cuda_device: int | None = None) -> None:
        """:meth:`run_engine` in a worker thread, on ``cuda_device`` (CUDA's current device is per thread)."""
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        self.run_engine()

    async def run_engine_async(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Run :meth:`run_engine` in ``loop``'s default executor, so the loop can read the streams meanwhile."""
        loop = get_asyncio_loop(loop)
        device = self.inference_wrapped_model.device
        cuda_device = None
        if device.type == "cuda":
            cuda_device = device.index if device.index is not None else torch.cuda.current_device()
        await loop.run_in_executor(None, self._wrapped_run_engine, cuda_device)

    # ---- whole batches ---------------------------------------------------------------------------------

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
            return self._generate_static_batches(prompts, add_BOS, encoder_prompts, params, inference_requests)
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
        self, prompts: list[str] | None, add_BOS: bool, encoder_prompts: list[str] | None, params: SamplingParams,
        inference_requests: list[InferenceRequest] | None,
    ) -> list[InferenceRequest]:
        """Queue the requests in the scheduler and serve them with :meth:`run_engine` (the static-batch loop)."""
        if inference_requests is None:
            if prompts is None:
                raise ValueError("StaticInferenceEngine.generate needs prompts or inference_requests")
            if encoder_prompts is not None and len(encoder_prompts) != len(prompts):
                raise ValueError(f"StaticInferenceEngine.generate: {len(prompts)} prompts but {len(encoder_prompts)} "
                                 "encoder_prompts")
        request_ids: list[Any] = []
        try:
            if inference_requests is None:
                for i, prompt in enumerate(prompts):
                    request_ids.append(self.add_request(
                        prompt=prompt, add_BOS=add_BOS, sampling_params=params,
                        encoder_prompt=None if encoder_prompts is None else encoder_prompts[i]))
            else:
                for request in inference_requests:
                    request_ids.append(self.add_request(inference_request=request, add_BOS=add_BOS))
            self.run_engine()
        except BaseException as error:
            self.scheduler.fail_requests(request_ids, error)
            raise
        return [self.scheduler.completed_request_pool[request_id] for request_id in request_ids]
