"""Prompt tokenization across ranks (Megatron-Core's ``dynamic_text_gen_server.tokenization``; one implementation,
shared with the legacy server)."""

from megatron_core.inference.text_generation_server.tokenization import tokenize_prompts

__all__ = ["tokenize_prompts"]
