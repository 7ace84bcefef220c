"""Inference wrapper of ``LLaVAModel`` (Megatron-Core's ``VLMInferenceWrapper``).

``prep_inference_input`` takes one batch's images with its prompt tokens and starts a fresh
:class:`StaticInferenceContext` sized for the text plus the image embeddings. The prefill forward
encodes the images and caches the combined sequence (the static-batch loop advances the cache by
the combined length the model returned); later decode steps feed one text token each, and the
model finds the images in the cache (``key_value_memory_dict["image_tokens_count"]``).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._ground import get_pg_size
from megatron_core.inference.contexts.base_context import BaseInferenceContext
from megatron_core.inference.contexts.static_context import StaticInferenceContext
from megatron_core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

__all__ = ["VLMInferenceWrapper"]


class VLMInferenceWrapper(GPTInferenceWrapper):
    """Runs a ``LLaVAModel`` on image tiles and text under a static KV cache."""

    def __init__(self, model: torch.nn.Module, inference_context: BaseInferenceContext | None = None) -> None:
        super().__init__(model, inference_context)
        if self.pp_group is not None:
            raise ValueError(f"VLMInferenceWrapper: pipeline parallelism (size {get_pg_size(self.pp_group)}) is not "
                             "supported; run VLM inference with pipeline_model_parallel_size = 1")

    def prep_inference_input(
        self, prompts_tokens: torch.Tensor, num_img_embeddings_per_tile: int, images: torch.Tensor,
        num_tiles: torch.Tensor, decoder_seq_length: int,
    ) -> dict[str, Any]:
        """Tokens and positions ``[b, s]`` plus the images; starts a context of ``s`` + image embeddings."""
        inference_input = super().prep_inference_input(prompts_tokens)
        num_tiles = torch.as_tensor(num_tiles, device=prompts_tokens.device).reshape(-1)
        image_token = self.inner_model.image_token_index
        image_tokens = int((prompts_tokens == image_token).sum())
        if image_tokens != num_tiles.numel():
            raise ValueError(f"VLMInferenceWrapper: the prompt holds {image_tokens} image tokens (id {image_token}) "
                             f"but num_tiles lists {num_tiles.numel()} images ({num_tiles.tolist()})")
        num_img_embeddings = int(num_img_embeddings_per_tile) * int(num_tiles.sum())
        batch, length = prompts_tokens.shape
        combined = length - image_tokens + num_img_embeddings
        if combined > decoder_seq_length:
            raise ValueError(f"VLMInferenceWrapper: prompt and generated tokens ({length - image_tokens}) plus image "
                             f"embeddings ({num_img_embeddings}) make {combined} positions, more than "
                             f"decoder_seq_length ({decoder_seq_length})")
        self.inference_context = StaticInferenceContext(batch, length + num_img_embeddings)
        inference_input.update(images=images, num_tiles=num_tiles, num_img_embeddings=num_img_embeddings,
                               decoder_seq_length=decoder_seq_length)
        return inference_input

    def get_batch_for_context_window(
        self, inference_input: dict[str, Any], context_start_position: int, context_end_position: int,
    ) -> dict[str, Any]:
        """The ``[start, end)`` slice of tokens and positions, with the images and tile counts."""
        window = super().get_batch_for_context_window(inference_input, context_start_position, context_end_position)
        for key in ("images", "num_tiles", "num_img_embeddings", "decoder_seq_length"):
            window[key] = inference_input[key]
        return window

    def _forward(self, inference_input: dict[str, Any]) -> torch.Tensor:
        """Logits ``[b, L, V]`` over the combined (image plus text) positions of this window."""
        output = self.model(
            inference_input["images"], inference_input["tokens"], position_ids=inference_input["position_ids"],
            attention_mask=None, inference_context=self.inference_context,
            num_image_tiles=inference_input["num_tiles"], runtime_gather_output=True,
        )
        return output[0] if isinstance(output, tuple) else output
