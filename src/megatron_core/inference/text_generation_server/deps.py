"""The one place the server's optional dependencies are imported."""

from __future__ import annotations

from types import ModuleType


def require_server_deps() -> tuple[ModuleType, ModuleType]:
    """``(fastapi, uvicorn)``, or an ImportError naming the ``server`` extra."""
    try:
        import fastapi
        import uvicorn
    except ImportError as error:
        raise ImportError(
            f"the inference HTTP server needs fastapi and uvicorn ({error.name} is missing); "
            "install them with: pip install 'megatron_core[server]'"
        ) from error
    return fastapi, uvicorn
