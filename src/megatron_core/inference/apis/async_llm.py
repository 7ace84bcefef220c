"""Asynchronous high-level API and HTTP serving (Megatron-Core's ``apis.async_llm.MegatronAsyncLLM``).

With ``use_coordinator=True`` (the default, as in Megatron-Core) ``generate`` and the lifecycle
methods (``pause`` ... ``shutdown``) go through the data-parallel coordinator and its client
(:mod:`._llm_base`), and :meth:`serve` starts Megatron-Core's text-generation server
(:mod:`~megatron_core.inference.text_generation_server.dynamic_text_gen_server`) on the primary
rank; :meth:`submit`, :meth:`stream` and :meth:`cancel` need ``use_coordinator=False``.

With ``use_coordinator=False`` (which Megatron-Core refuses) the engine loop (:meth:`DynamicInferenceEngine.run_engine`) runs on a background thread's event
loop; ``await llm.generate(...)`` from any event loop submits requests to it and awaits their
results, so many concurrent callers share continuous batches. :meth:`stream` yields tokens as
they are generated and cancels the request (freeing its KV blocks) if the consumer stops early.
:meth:`serve` starts the OpenAI-compatible server (needs the ``server`` extra).

Nobody waits forever: a request that fails finishes as ``FAILED`` (``request.error`` says why); if
the engine loop itself stops, every pending request fails at once, :attr:`engine_failure` says
why, and new requests raise ``EngineFailedError``; :meth:`stream` also re-checks the loop every
``LIVENESS_POLL_S`` seconds while it waits for a token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from megatron_core.inference.apis._llm_base import Prompts, _EventLoopManager, _MegatronLLMBase
from megatron_core.inference.apis.finish_reason import request_finish_reason as request_finish_reason
from megatron_core.inference.apis.serve_config import ServeConfig
from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.engines.dynamic_engine import EngineState
from megatron_core.inference.engines.fault_isolation import EngineFailedError, describe
from megatron_core.inference.inference_request import DynamicInferenceRequest
from megatron_core.inference.sampling_params import SamplingParams

__all__ = ["MegatronAsyncLLM"]

LIVENESS_POLL_S = 1.0


class MegatronAsyncLLM(_MegatronLLMBase):
    """``await MegatronAsyncLLM(...).generate(prompts, sampling_params)``; ``await llm.serve(ServeConfig(...))``."""

    def __init__(
        self, *, model: Any, tokenizer: Any, inference_config: InferenceConfig | None = None,
        use_coordinator: bool = True, coordinator_host: str | None = None, coordinator_port: int | None = None,
    ) -> None:
        super().__init__(
            model=model, tokenizer=tokenizer, inference_config=inference_config, use_coordinator=use_coordinator,
            coordinator_host=coordinator_host, coordinator_port=coordinator_port,
        )
        self._engine_task: Any = None
        if not use_coordinator:
            self._loop_manager = _EventLoopManager()
            self._loop_manager.start()
            self._engine_task = self._loop_manager.submit(self._engine.run_engine())
        self._server: Any = None
        self._serve_task: asyncio.Task | None = None
        self._serve_started = False  # the coordinator-mode text-generation server runs

    def _check_open(self) -> None:
        if self._shutdown_called:
            raise RuntimeError("MegatronAsyncLLM is shut down")

    def _check_direct(self, method: str) -> None:
        if self._use_coordinator:
            raise RuntimeError(f"MegatronAsyncLLM.{method} needs use_coordinator=False (the coordinator's client "
                               "returns finished requests only)")

    @property
    def engine_failure(self) -> str | None:
        """Why the engine loop stopped when nobody asked it to (``None`` while it runs or after :meth:`shutdown`)."""
        if self._engine.failure is not None:
            return describe(self._engine.failure)
        task = self._engine_task if not self._use_coordinator else getattr(self._engine, "engine_loop_task", None)
        if task is not None and task.done() and not self._shutdown_called:
            error = task.exception() if not task.cancelled() else None
            return describe(error) if error is not None else "the engine loop stopped"
        return None

    def _check_engine(self) -> None:
        failure = self.engine_failure
        if failure is not None:
            raise EngineFailedError(f"the inference engine stopped after an error: {failure}")

    def submit(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> tuple[int, Any]:
        """Queue one prompt; returns ``(request_id, concurrent future of the finished request)`` (direct mode)."""
        self._check_direct("submit")
        self._check_open()
        self._check_engine()
        request_id = next(self._engine.request_counter)
        return request_id, self._engine.add_request(request_id, prompt, sampling_params or SamplingParams())

    async def generate(
        self, prompts: Prompts, sampling_params: SamplingParams | None = None
    ) -> DynamicInferenceRequest | list[DynamicInferenceRequest]:
        """One request for a single prompt, a list (input order) for a batch; primary rank only with the coordinator."""
        normalized, is_batch = self._normalize_prompts(prompts)
        if self._use_coordinator:
            self._check_open()
            self._assert_primary()
            if not normalized:
                return []
            results = await self._loop_manager.run_async(
                self._generate_impl(normalized, sampling_params or SamplingParams()))
            return results if is_batch else results[0]
        futures = [asyncio.wrap_future(self.submit(p, sampling_params)[1]) for p in normalized]
        while futures:
            _, pending = await asyncio.wait(futures, timeout=LIVENESS_POLL_S)
            if not pending:
                break
            self._check_engine()  # a dead loop resolves no more futures
        results = [f.result() for f in futures]
        return results if is_batch else results[0]

    async def stream(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None
    ) -> AsyncIterator[tuple[int | None, DynamicInferenceRequest]]:
        """Yield ``(token, request)`` per generated token, then ``(None, finished request)``.

        Closing the iterator early (a client went away) cancels the request and frees its KV blocks.
        """
        _, tokens = self.open_stream(prompt, sampling_params)
        try:
            async for item in tokens:
                yield item
        finally:
            await tokens.aclose()

    def open_stream(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None
    ) -> tuple[int, AsyncIterator[tuple[int | None, DynamicInferenceRequest]]]:
        """Queue ``prompt`` now (a refused request raises here) and return ``(request_id, token iterator)``.

        The iterator is :meth:`stream`'s; a caller that may never iterate it must :meth:`cancel` the request.
        """
        self._check_direct("open_stream")
        self._check_open()
        self._check_engine()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        request_id = next(self._engine.request_counter)
        self._engine.add_token_listener(
            request_id, lambda request, token: loop.call_soon_threadsafe(queue.put_nowait, (token, request))
        )
        try:
            self._engine.add_request(request_id, prompt, sampling_params or SamplingParams())
        except BaseException:
            self._engine.remove_token_listeners(request_id)
            raise
        return request_id, self._tokens(request_id, queue)

    async def _tokens(
        self, request_id: int, queue: asyncio.Queue
    ) -> AsyncIterator[tuple[int | None, DynamicInferenceRequest]]:
        finished = False
        try:
            while True:
                try:
                    token, request = await asyncio.wait_for(queue.get(), LIVENESS_POLL_S)
                except asyncio.TimeoutError:
                    self._check_engine()  # a dead loop sends no more tokens
                    continue
                if token is None:
                    finished = True
                    yield None, request
                    return
                yield token, request
        finally:
            if not finished:
                self._engine.cancel_request(request_id)

    def cancel(self, request_id: int) -> None:
        """Cancel a request (frees its KV blocks at the next step); direct mode."""
        self._check_direct("cancel")
        self._engine.cancel_request(request_id)

    async def _lifecycle(self, signal: str, state: EngineState) -> None:
        self._assert_coordinator()
        await self._loop_manager.run_async(self._signal_impl(signal, state))

    async def pause(self) -> None:
        """PAUSE the engines (they keep their requests and take no steps); coordinator mode only."""
        await self._lifecycle("pause_engines", EngineState.PAUSED)

    async def unpause(self) -> None:
        """Return paused engines to RUNNING; coordinator mode only."""
        await self._lifecycle("unpause_engines", EngineState.RUNNING)

    async def suspend(self) -> None:
        """SUSPEND paused engines (call :meth:`pause` first); coordinator mode only."""
        await self._lifecycle("suspend_engines", EngineState.SUSPENDED)

    async def resume(self) -> None:
        """RESUME suspended engines (they return to PAUSED); coordinator mode only."""
        await self._lifecycle("resume_engines", EngineState.RESUMED)

    async def _serve_through_coordinator(self, serve_config: ServeConfig, blocking: bool) -> None:
        """Megatron-Core's coordinator-mode ``serve``: the text-generation server on the primary rank."""
        if self._is_primary_rank:
            import torch.distributed as dist

            from megatron_core.inference.text_generation_server.dynamic_text_gen_server import (
                start_text_gen_server,
            )

            start_text_gen_server(
                coordinator_addr=self._coord_runtime.coord_addr, tokenizer=self._tokenizer,
                rank=dist.get_rank() if dist.is_initialized() else 0, server_port=serve_config.port,
                parsers=serve_config.parsers, verbose=serve_config.verbose,
                num_replicas=serve_config.frontend_replicas, hostname=serve_config.host,
            )
            self._serve_started = True
        if blocking:
            await self.wait_for_shutdown()

    async def serve(self, serve_config: ServeConfig, *, blocking: bool = True) -> None:
        """Start the HTTP server on ``serve_config.host:port`` (see the module docstring for which one)."""
        self._check_open()
        if self._use_coordinator:
            await self._serve_through_coordinator(serve_config, blocking)
            return
        from megatron_core.inference.text_generation_server.server import create_uvicorn_server

        self._server = create_uvicorn_server(self, serve_config)
        if blocking:
            await self._server.serve()
        else:
            self._serve_task = asyncio.get_running_loop().create_task(self._server.serve())
            while not self._server.started and not self._serve_task.done():
                await asyncio.sleep(0.01)
            if self._serve_task.done():
                self._serve_task.result()

    async def wait_for_server(self) -> None:
        """Wait until a server started with ``serve(..., blocking=False)`` has stopped."""
        if self._serve_task is not None:
            await self._serve_task

    @property
    def server_port(self) -> int | None:
        """The port the HTTP server listens on (useful with ``port=0``)."""
        if self._serve_started:
            from megatron_core.inference.text_generation_server.dynamic_text_gen_server import (
                text_generation_server,
            )

            return text_generation_server.bound_port()
        if self._server is None or not self._server.servers:
            return None
        return self._server.servers[0].sockets[0].getsockname()[1]

    async def shutdown(self) -> None:
        """Stop the HTTP server (it drains in-flight requests), cancel what is left, stop the engine loop."""
        if self._shutdown_called:
            return
        if self._use_coordinator:
            await self._shutdown_coordinator_mode()
            return
        if self._server is not None:
            self._server.should_exit = True
            if self._serve_task is not None:
                await self._serve_task
        self._shutdown_called = True
        try:
            await asyncio.wrap_future(self._loop_manager.submit(self._engine.shutdown(cancel_pending=True)))
            await asyncio.wrap_future(self._engine_task)
        except Exception:  # noqa: BLE001 - the loop had already failed (logged then); shut down regardless
            if self._engine.failure is None:
                raise
        finally:
            self._loop_manager.stop()

    async def _shutdown_coordinator_mode(self) -> None:
        self._shutdown_called = True
        try:
            if self._serve_started:
                from megatron_core.inference.text_generation_server.dynamic_text_gen_server import (
                    stop_text_gen_server,
                )

                await asyncio.to_thread(stop_text_gen_server)
                self._serve_started = False
            await self._loop_manager.run_async(self._shutdown_impl())
        finally:
            self._loop_manager.stop()

    async def wait_for_shutdown(self) -> None:
        """Wait until the engine loop has stopped."""
        if self._use_coordinator:
            if not self._shutdown_called:
                await self._loop_manager.run_async(self._wait_for_shutdown_impl())
            return
        await asyncio.wrap_future(self._engine_task)

    async def __aenter__(self) -> MegatronAsyncLLM:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()


