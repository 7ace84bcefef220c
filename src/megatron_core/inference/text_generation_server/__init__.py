"""OpenAI-compatible HTTP server for ``MegatronAsyncLLM`` (needs the ``server`` extra: fastapi, uvicorn).

Importing this package is cheap; FastAPI and uvicorn are imported only when a server is built
(:func:`megatron_core.inference.text_generation_server.server.build_app`).

Megatron-Core's servers live here too: the legacy :class:`MegatronServer` (``PUT /api``, importable
from this package as in Megatron-Core, loaded on first use) and the coordinator-fed
:mod:`.dynamic_text_gen_server`.
"""

from typing import Any

__all__ = ["MegatronServer"]


def __getattr__(name: str) -> Any:
    if name == "MegatronServer":
        from megatron_core.inference.text_generation_server.text_generation_server import MegatronServer

        return MegatronServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
