"""Shared core of ``MegatronLLM`` and ``MegatronAsyncLLM`` (Megatron-Core's ``apis._llm_base``).

Builds the pipeline ``DynamicInferenceContext`` -> ``GPTInferenceWrapper`` ->
``TextGenerationController`` -> ``DynamicInferenceEngine`` from a model, a tokenizer and an
:class:`InferenceConfig`, and normalises prompts (one string, one token list, or a batch of
either). A hybrid model's Mamba state config is read from the model when the inference config
leaves it unset (:func:`with_mamba_state_config`).

``use_coordinator=True`` (as in Megatron-Core) starts a background event loop on which the engine
listens to the data-parallel inference coordinator (:mod:`._coordinator_runtime`); the primary
rank (global rank 0, or the only process) submits requests through an ``InferenceClient`` and
drives pause / unpause / suspend / resume / shutdown. ``use_coordinator=False`` drives the engine
in this process: ``MegatronLLM`` calls ``engine.generate``; ``MegatronAsyncLLM`` runs the engine
loop on a background thread (every rank drives its own engine; under tensor or pipeline
parallelism all ranks must submit the same requests in the same order).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections.abc import Coroutine
from typing import Any

import torch.distributed as dist

from megatron_core.inference.apis._coordinator_runtime import CoordinatorRuntime
from megatron_core.inference.config import InferenceConfig, MambaInferenceStateConfig
from megatron_core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_core.inference.engines.dynamic_engine import DynamicInferenceEngine, EngineState
from megatron_core.inference.inference_request import DynamicInferenceRequest
from megatron_core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron_core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

Prompts = str | list[int] | list[str] | list[list[int]]


class _EventLoopManager:
    """A daemon thread running one asyncio loop; coroutines are submitted to it from any thread."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread and its loop (idempotent)."""
        if self._thread is not None:
            return
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            loop.call_soon(ready.set)
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="megatron-inference-loop", daemon=True)
        self._thread.start()
        ready.wait()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The background loop."""
        if self._loop is None:
            raise RuntimeError("_EventLoopManager.start() has not been called")
        return self._loop

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule ``coro`` on the background loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run_sync(self, coro: Coroutine) -> Any:
        """Run ``coro`` on the background loop and wait for it (never from that loop itself: it would deadlock)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is self._loop:
            coro.close()
            raise RuntimeError("run_sync called on the background loop itself; await run_async instead")
        return self.submit(coro).result()

    async def run_async(self, coro: Coroutine) -> Any:
        """Run ``coro`` on the background loop and await it from any other loop."""
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self) -> None:
        """Stop the loop and join the thread (idempotent)."""
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._thread = None


def with_mamba_state_config(inference_config: InferenceConfig, model: Any) -> InferenceConfig:
    """``inference_config``, with ``mamba_inference_state_config`` read from ``model`` when it is a hybrid model
    and the field is unset (a copy; the caller's config is not changed)."""
    if inference_config.mamba_inference_state_config is not None:
        return inference_config
    mamba = MambaInferenceStateConfig.from_model(model)
    return inference_config if mamba is None else dataclasses.replace(inference_config,
                                                                      mamba_inference_state_config=mamba)


class _MegatronLLMBase:
    """Engine pipeline plus prompt normalisation."""

    def __init__(
        self, *, model: Any, tokenizer: Any, inference_config: InferenceConfig | None = None,
        use_coordinator: bool = True, coordinator_host: str | None = None, coordinator_port: int | None = None,
    ) -> None:
        if (coordinator_host is not None or coordinator_port is not None) and not use_coordinator:
            raise ValueError("coordinator_host/coordinator_port require use_coordinator=True")
        inference_config = with_mamba_state_config(inference_config if inference_config is not None
                                                   else InferenceConfig(), model)
        context = DynamicInferenceContext(model.config, inference_config)
        wrapper = GPTInferenceWrapper(model, context)
        controller = TextGenerationController(inference_wrapped_model=wrapper, tokenizer=tokenizer)
        self._engine = DynamicInferenceEngine(controller, context)
        self._context = context
        self._controller = controller
        self._tokenizer = tokenizer
        self._use_coordinator = use_coordinator
        self._shutdown_called = False
        self._is_primary_rank = not use_coordinator or not dist.is_initialized() or dist.get_rank() == 0
        self._loop_manager: _EventLoopManager | None = None
        self._coord_runtime: CoordinatorRuntime | None = None
        if use_coordinator:
            self._start_coordinator(coordinator_host, coordinator_port)

    def _start_coordinator(self, host: str | None, port: int | None) -> None:
        """Start the background loop, the coordinator link and (primary rank) the client; undo all on failure."""
        loop_manager = _EventLoopManager()
        loop_manager.start()
        runtime = CoordinatorRuntime(self._engine, is_primary=self._is_primary_rank, coordinator_host=host,
                                     coordinator_port=port)
        try:
            loop_manager.run_sync(runtime.setup(loop=loop_manager.loop))
        except BaseException:
            try:
                loop_manager.run_sync(runtime.teardown())
            except Exception:  # noqa: BLE001 - best effort; the original failure is the one to report
                pass
            loop_manager.stop()
            raise
        self._loop_manager = loop_manager
        self._coord_runtime = runtime

    @property
    def engine(self) -> DynamicInferenceEngine:
        """The dynamic engine."""
        return self._engine

    @property
    def context(self) -> DynamicInferenceContext:
        """The paged KV cache."""
        return self._context

    @property
    def controller(self) -> TextGenerationController:
        """The generation controller."""
        return self._controller

    @property
    def tokenizer(self) -> Any:
        """The tokenizer."""
        return self._tokenizer

    @property
    def is_primary_rank(self) -> bool:
        """Whether ``generate`` may be called here: global rank 0 with the coordinator, every rank without."""
        return self._is_primary_rank

    def _assert_primary(self) -> None:
        if not self._is_primary_rank:
            raise RuntimeError("generate(...) is only valid on the primary rank (global rank 0) with "
                               "use_coordinator=True")

    def _assert_coordinator(self) -> None:
        if not self._use_coordinator:
            raise RuntimeError("this method requires use_coordinator=True")

    # ---- coroutines run on the background loop in coordinator mode ----

    async def _generate_impl(self, prompts: list, sampling_params: Any) -> list[DynamicInferenceRequest]:
        """Submit ``prompts`` through the client and gather the finished requests in input order."""
        client = self._coord_runtime.client
        return list(await asyncio.gather(*(client.add_request(p, sampling_params) for p in prompts)))

    async def _signal_impl(self, signal: str, state: EngineState) -> None:
        """Send ``signal`` (a client method name) from the primary rank; every rank waits for ``state``."""
        if self._is_primary_rank:
            getattr(self._coord_runtime.client, signal)()
        await self._engine.wait_until(state)

    async def _shutdown_impl(self) -> None:
        """Pause (STOP is honoured only when paused), stop the engines, close the client and the coordinator."""
        if self._is_primary_rank:
            if self._engine.state == EngineState.RUNNING:
                await self._signal_impl("pause_engines", EngineState.PAUSED)
            await self._signal_impl("stop_engines", EngineState.STOPPED)
            await self._coord_runtime.teardown()
        else:
            await self._engine.engine_loop_task

    async def _wait_for_shutdown_impl(self) -> None:
        await self._engine.engine_loop_task

    @staticmethod
    def _normalize_prompts(prompts: Prompts) -> tuple[list[str] | list[list[int]], bool]:
        """``(list of prompts, was_batch)``: a string or a list of ints is one prompt."""
        if isinstance(prompts, str):
            return [prompts], False
        if isinstance(prompts, (list, tuple)):
            if not prompts:
                return [], True
            first = prompts[0]
            if isinstance(first, int):
                return [list(prompts)], False
            if isinstance(first, (str, list, tuple)):
                return list(prompts), True
            raise TypeError(
                f"unsupported prompt element type {type(first).__name__}; expected str, list[int], list[str] "
                "or list[list[int]]"
            )
        raise TypeError(f"prompts must be str, list[int], list[str] or list[list[int]], got {type(prompts).__name__}")
