"""OpenAI-compatible HTTP server for ``MegatronAsyncLLM`` (needs the ``server`` extra: fastapi, uvicorn).

Importing this package is cheap; FastAPI and uvicorn are imported only when a server is built
(:func:`megatron_core.inference.text_generation_server.server.build_app`).
"""
