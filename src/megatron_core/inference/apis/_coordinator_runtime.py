"""The coordinator side of ``use_coordinator=True`` (Megatron-Core's ``apis._llm_base._CoordinatorRuntime``).

On every rank the engine starts listening to the data-parallel coordinator (global rank 0 launches
it); the primary rank (global rank 0) also opens an :class:`InferenceClient` through which
``generate`` and the lifecycle calls travel. Both run on the background loop of the owning
``MegatronLLM`` / ``MegatronAsyncLLM``. Teardown asks the coordinator to exit and waits for its
process (or thread) to end, so nothing is left running.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["CoordinatorRuntime"]

_JOIN_TIMEOUT_S = 10.0


class CoordinatorRuntime:
    """Owns the coordinator link of one engine and, on the primary rank, the client."""

    def __init__(self, engine: Any, *, is_primary: bool, coordinator_host: str | None,
                 coordinator_port: int | None) -> None:
        self._engine = engine
        self._is_primary = is_primary
        self._host = coordinator_host
        self._port = coordinator_port
        self._client: Any = None
        self._coord_addr: str | None = None

    async def setup(self, *, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine's coordinator link on every rank; open the client on the primary rank."""
        kwargs: dict[str, Any] = {"loop": loop}
        if self._host is not None:
            kwargs["hostname"] = self._host
        if self._port is not None:
            kwargs["inference_coordinator_port"] = self._port
        self._coord_addr = await self._engine.start_listening_to_data_parallel_coordinator(**kwargs)
        if self._is_primary:
            from megatron_core.inference.inference_client import InferenceClient

            client = InferenceClient(self._coord_addr, deserialize=True)
            client.start(loop=loop)
            self._client = client

    async def teardown(self) -> None:
        """Tell the coordinator to exit, close the client and wait for the coordinator to end (idempotent)."""
        if not self._is_primary:
            return
        if self._client is not None:
            try:
                self._client.shutdown_coordinator()
                await asyncio.sleep(0.05)  # let the SHUTDOWN leave before the socket closes
            finally:
                self._client.stop()
                self._client = None
        handle = getattr(self._engine, "inference_coordinator_process", None)
        if handle is None:
            return
        await asyncio.to_thread(handle.join, _JOIN_TIMEOUT_S)
        if handle.is_alive():
            handle.terminate()
            await asyncio.to_thread(handle.join, _JOIN_TIMEOUT_S)
        kill = getattr(handle, "kill", None)
        if handle.is_alive() and kill is not None:
            kill()
            await asyncio.to_thread(handle.join, _JOIN_TIMEOUT_S)

    @property
    def client(self) -> Any:
        """The :class:`InferenceClient` on the primary rank; ``None`` elsewhere."""
        return self._client

    @property
    def coord_addr(self) -> str | None:
        """The coordinator's address, as ``start_listening_to_data_parallel_coordinator`` returned it."""
        return self._coord_addr
