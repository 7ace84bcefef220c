"""Generation for vision-language models (Megatron-Core's ``VLMTextGenerationController``).

Serves one :class:`VLMInferenceRequest` at a time (as Megatron-Core does): its images, tile counts and
sequence limit go to the wrapper (:class:`VLMInferenceWrapper`) with the prompt tokens, and the
static-batch loop (``_static_batch``) generates with the wrapper's KV cache.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.inference.inference_request import VLMInferenceRequest
from megatron_core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

__all__ = ["VLMTextGenerationController"]


class VLMTextGenerationController(TextGenerationController):
    """A :class:`TextGenerationController` for requests with images (batch size 1)."""

    def prep_inference_input(
        self, prompts_tokens: torch.Tensor, active_requests: dict[Any, Any], use_attention_mask: bool = False,
    ) -> dict[str, Any]:
        """The wrapper's inputs for the single request of the batch."""
        if len(active_requests) != 1:
            raise ValueError(f"VLMTextGenerationController serves one request at a time, got {len(active_requests)} "
                             "(use max_batch_size=1)")
        request = next(iter(active_requests.values()))
        if not isinstance(request, VLMInferenceRequest):
            raise ValueError(f"VLMTextGenerationController: request {request.request_id} is a "
                             f"{type(request).__name__}; expected a VLMInferenceRequest (with imgs and num_tiles)")
        if request.imgs is None or request.num_tiles is None:
            raise ValueError(f"VLMTextGenerationController: request {request.request_id} has imgs={request.imgs!r} "
                             f"and num_tiles={request.num_tiles!r}; both are required")
        params = request.sampling_params
        if params.return_log_probs:
            raise ValueError(f"VLMTextGenerationController: return_log_probs ({params.return_log_probs}) is not "
                             "supported (the logits cover image embeddings as well as prompt tokens)")
        return self.inference_wrapped_model.prep_inference_input(
            prompts_tokens, request.num_img_embeddings_per_tile, request.imgs, request.num_tiles,
            request.decoder_seq_length,
        )
