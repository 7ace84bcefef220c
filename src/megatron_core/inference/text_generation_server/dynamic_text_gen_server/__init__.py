"""Megatron-Core's text-generation server fed by the data-parallel coordinator (``dynamic_text_gen_server``)."""

from megatron_core.inference.text_generation_server.dynamic_text_gen_server.text_generation_server import (
    start_text_gen_server,
    stop_text_gen_server,
)

__all__ = ["start_text_gen_server", "stop_text_gen_server"]
