"""``POST /start_profile`` and ``/stop_profile`` (also under ``/v1``; Megatron-Core's ``endpoints.profile``).

Each sends a control signal through the client and the coordinator to every engine, which calls
``cudaProfilerStart`` / ``cudaProfilerStop`` (nothing on a machine without CUDA). Pair with
``nsys profile --capture-range=cudaProfilerApi`` to bracket a capture.
"""

from __future__ import annotations

from typing import Any

from megatron_core.inference.text_generation_server.dynamic_text_gen_server.endpoints.common import (
    ServerState,
)

__all__ = ["start_profile", "stop_profile"]


async def start_profile(state: ServerState) -> tuple[int, dict[str, Any]]:
    """Ask every engine to start the CUDA profiler."""
    if state.client is None:
        return 503, {"status": "error", "details": "client not initialized"}
    state.client.start_cuda_profiler()
    return 200, {"status": "ok", "action": "start_profile"}


async def stop_profile(state: ServerState) -> tuple[int, dict[str, Any]]:
    """Ask every engine to stop the CUDA profiler."""
    if state.client is None:
        return 503, {"status": "error", "details": "client not initialized"}
    state.client.stop_cuda_profiler()
    return 200, {"status": "ok", "action": "stop_profile"}
