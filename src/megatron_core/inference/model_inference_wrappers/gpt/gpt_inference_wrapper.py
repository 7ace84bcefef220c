"""Inference wrapper of ``GPTModel`` (Megatron-Core's ``GPTInferenceWrapper``)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._ground.decorators import deprecate_args
from megatron_core.inference.contexts.base_context import BaseInferenceContext
from megatron_core.inference.model_inference_wrappers.abstract_model_inference_wrapper import (
    AbstractModelInferenceWrapper,
)

__all__ = ["GPTInferenceWrapper"]

DEPRECATED_ARGS = ["inference_wrapper_config", "pg_collection"]
"""Former keyword arguments of ``GPTInferenceWrapper``; passing one raises ``TypeError``."""


class GPTInferenceWrapper(AbstractModelInferenceWrapper):
    """Runs a ``GPTModel`` under an inference context."""

    @deprecate_args(*DEPRECATED_ARGS)
    def __init__(self, model: torch.nn.Module, inference_context: BaseInferenceContext | None = None) -> None:
        super().__init__(model, inference_context)

    def prep_inference_input(self, prompts_tokens: torch.Tensor) -> dict[str, Any]:
        """Tokens ``[b, s]`` and positions ``0..s-1``; the causal mask is implied (``None``)."""
        b, s = prompts_tokens.shape
        positions = torch.arange(s, device=prompts_tokens.device).unsqueeze(0).expand(b, s)
        return {"tokens": prompts_tokens, "position_ids": positions, "attention_mask": None}

    def get_batch_for_context_window(
        self, inference_input: dict[str, Any], context_start_position: int, context_end_position: int
    ) -> dict[str, Any]:
        """The slice ``[start, end)`` of tokens and positions (static batching)."""
        return {
            "tokens": inference_input["tokens"][:, context_start_position:context_end_position],
            "position_ids": inference_input["position_ids"][:, context_start_position:context_end_position],
            "attention_mask": None,
        }
