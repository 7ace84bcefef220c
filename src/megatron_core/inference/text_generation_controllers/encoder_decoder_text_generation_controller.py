"""Generation for encoder-decoder models (Megatron-Core's ``EncoderDecoderTextGenerationController``).

Each request carries an ``encoder_prompt`` next to its decoder prompt; the wrapper (e.g.
:class:`T5InferenceWrapper`) tokenizes and pads the encoder prompts. Batches are served by the
static-batch loop (``_static_batch``), through ``StaticInferenceEngine``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

__all__ = ["EncoderDecoderTextGenerationController"]


class EncoderDecoderTextGenerationController(TextGenerationController):
    """A :class:`TextGenerationController` whose model also reads each request's ``encoder_prompt``."""

    def prep_inference_input(
        self, prompts_tokens: torch.Tensor, active_requests: dict[Any, Any], use_attention_mask: bool = False,
    ) -> dict[str, Any]:
        """The wrapper's inputs for the padded decoder prompts and the requests' encoder prompts."""
        missing = [r.request_id for r in active_requests.values() if r.encoder_prompt is None]
        if missing:
            raise ValueError(f"EncoderDecoderTextGenerationController: requests {missing} have no encoder_prompt")
        encoder_prompts = [r.encoder_prompt for r in active_requests.values()]
        return self.inference_wrapped_model.prep_inference_input(prompts_tokens, encoder_prompts,
                                                                 tokenizer=self.tokenizer)
