"""Synchronous high-level API (Megatron-Core's ``apis.llm.MegatronLLM``).

With ``use_coordinator=True`` (the default, as in Megatron-Core) requests travel through the
data-parallel coordinator and its client on a background loop (:mod:`._llm_base`), and the
lifecycle methods (``pause`` ... ``shutdown``) control the engines; with ``use_coordinator=False``
``generate`` runs ``engine.generate`` in the calling thread and the lifecycle methods other than
``shutdown`` raise ``RuntimeError``.
"""

from __future__ import annotations

from typing import Any

from megatron_core.inference.apis._llm_base import Prompts, _MegatronLLMBase
from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.engines.dynamic_engine import EngineState
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
        """Generate for one prompt or a batch (continuous batching underneath); primary rank only with the coordinator."""
        if self._shutdown_called:
            raise RuntimeError("MegatronLLM.generate called after shutdown()")
        self._assert_primary()
        normalized, _ = self._normalize_prompts(prompts)
        if not normalized:
            return []
        params = sampling_params or SamplingParams()
        if self._use_coordinator:
            return self._loop_manager.run_sync(self._generate_impl(normalized, params))
        records = self._engine.generate(normalized, params)
        return [r.merge() for r in records]

    def _lifecycle(self, signal: str, state: EngineState) -> None:
        self._assert_coordinator()
        self._loop_manager.run_sync(self._signal_impl(signal, state))

    def pause(self) -> None:
        """PAUSE the engines (they keep their requests and take no steps); coordinator mode only."""
        self._lifecycle("pause_engines", EngineState.PAUSED)

    def unpause(self) -> None:
        """Return paused engines to RUNNING; coordinator mode only."""
        self._lifecycle("unpause_engines", EngineState.RUNNING)

    def suspend(self) -> None:
        """SUSPEND paused engines (call :meth:`pause` first); coordinator mode only."""
        self._lifecycle("suspend_engines", EngineState.SUSPENDED)

    def resume(self) -> None:
        """RESUME suspended engines (they return to PAUSED); coordinator mode only."""
        self._lifecycle("resume_engines", EngineState.RESUMED)

    def shutdown(self) -> None:
        """Stop the engines and the coordinator (coordinator mode), or free the KV cache; idempotent."""
        if self._shutdown_called:
            return
        self._shutdown_called = True
        if self._use_coordinator:
            try:
                self._loop_manager.run_sync(self._shutdown_impl())
            finally:
                self._loop_manager.stop()
            return
        self._engine.reset()
        self._context.kv_memory.clear()

    def wait_for_shutdown(self) -> None:
        """Block until the engine loop has ended (coordinator mode; returns at once without it)."""
        if self._use_coordinator and self._loop_manager is not None and not self._shutdown_called:
            self._loop_manager.run_sync(self._wait_for_shutdown_impl())

    def __enter__(self) -> MegatronLLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
