"""Inference wrapper of ``T5Model`` (Megatron-Core's ``T5InferenceWrapper``).

Each request has an encoder prompt (text; every ``<mask>`` becomes the next sentinel of the
tokenizer's ``additional_special_tokens_ids``, as in T5 pretraining) and a decoder prompt (the
controller's padded ``[b, s]`` tokens, usually just BOS). The encoder prompts are padded with the
tokenizer's ``pad`` to the model's ``max_sequence_length``. As in Megatron-Core there is no KV
cache: every step runs the encoder and the decoder over the whole decoder prefix. The masks are
built from the prompts' lengths (encoder padding hidden from the encoder and from cross-attention;
causal decoder), so any token id, 0 included, may appear in a prompt.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core._ground import get_pg_size
from megatron_core._wrapped_model import get_attr_wrapped_model
from megatron_core.inference.contexts.base_context import BaseInferenceContext
from megatron_core.inference.model_inference_wrappers.abstract_model_inference_wrapper import (
    AbstractModelInferenceWrapper,
)
from megatron_core.models.T5.t5_model import t5_extended_attention_mask

__all__ = ["T5InferenceWrapper"]

MASK_TEXT = "<mask>"


class T5InferenceWrapper(AbstractModelInferenceWrapper):
    """Runs a ``T5Model`` on encoder prompts and a growing decoder prefix.

    ``use_local`` is kept for Megatron-Core's signature: this library's T5 attention takes the same
    ``[b, 1, q, kv]`` masks for every layer spec.
    """

    def __init__(
        self, model: torch.nn.Module, inference_context: BaseInferenceContext | None = None, use_local: bool = False,
    ) -> None:
        super().__init__(model, inference_context)
        self.use_local = use_local
        if self.pp_group is not None:
            raise ValueError(f"T5InferenceWrapper: pipeline parallelism (size {get_pg_size(self.pp_group)}) is not "
                             "supported; run T5 inference with pipeline_model_parallel_size = 1")

    def prep_inference_input(
        self, prompts_tokens: torch.Tensor, encoder_prompts: list[str] | None = None, tokenizer: Any = None,
    ) -> dict[str, Any]:
        """Encoder tokens ``[b, max_sequence_length]``, decoder tokens ``[b, s]`` and their padding masks ``[b, *]``."""
        batch = prompts_tokens.shape[0]
        if encoder_prompts is None or len(encoder_prompts) != batch:
            count = None if encoder_prompts is None else len(encoder_prompts)
            raise ValueError(f"T5InferenceWrapper: {batch} decoder prompts need as many encoder_prompts, got {count}")
        if tokenizer is None or getattr(tokenizer, "pad", None) is None:
            raise ValueError("T5InferenceWrapper: encoder prompts need a tokenizer with a pad token (tokenizer.pad)")
        max_length = int(get_attr_wrapped_model(self.model, "max_sequence_length"))
        encoder_tokens = [self.tokenize_encoder_prompt(prompt, tokenizer) for prompt in encoder_prompts]
        too_long = {i: len(t) for i, t in enumerate(encoder_tokens) if len(t) > max_length}
        if too_long:
            raise ValueError(f"T5InferenceWrapper: encoder prompt lengths {too_long} (by batch index) exceed the "
                             f"model's max_sequence_length ({max_length})")
        lengths = torch.tensor([len(t) for t in encoder_tokens], device=prompts_tokens.device)
        padded = self.pad_encoder_prompts_tokens(encoder_tokens, max_length, tokenizer).to(prompts_tokens.device)
        positions = torch.arange(max_length, device=prompts_tokens.device)
        return {
            "encoder_tokens": padded,
            "decoder_tokens": prompts_tokens,
            "encoder_mask": positions[None, :] >= lengths[:, None],
            "decoder_mask": prompts_tokens == tokenizer.pad,
        }

    def tokenize_encoder_prompt(self, encoder_prompt: str, tokenizer: Any) -> list[int]:
        """Token ids of ``encoder_prompt``, each ``<mask>`` replaced by the next sentinel token."""
        pieces = encoder_prompt.split(MASK_TEXT)
        sentinels = deque(getattr(tokenizer, "additional_special_tokens_ids", None) or [])
        if len(pieces) - 1 > len(sentinels):
            raise ValueError(f"T5InferenceWrapper: the encoder prompt has {len(pieces) - 1} {MASK_TEXT} spans but the "
                             f"tokenizer has {len(sentinels)} sentinel tokens (additional_special_tokens_ids)")
        tokens: list[int] = []
        for index, piece in enumerate(pieces):
            tokens.extend(int(t) for t in tokenizer.tokenize(piece))
            if index < len(pieces) - 1:
                tokens.append(int(sentinels.popleft()))
        return tokens

    def pad_encoder_prompts_tokens(
        self, encoder_prompts_tokens_list: list[list[int]], max_sequence_length: int, tokenizer: Any,
    ) -> torch.Tensor:
        """The token lists padded with ``tokenizer.pad`` to ``[b, max_sequence_length]`` (the lists are extended)."""
        for tokens in encoder_prompts_tokens_list:
            tokens.extend([tokenizer.pad] * (max_sequence_length - len(tokens)))
        return torch.tensor(encoder_prompts_tokens_list, dtype=torch.long, device=self.device)

    def get_batch_for_context_window(
        self, inference_input: dict[str, Any], context_start_position: int, context_end_position: int,
    ) -> dict[str, Any]:
        """The whole encoder input and the decoder prefix ``[0, end)`` with Megatron's boolean masks (True = masked)."""
        encoder_tokens = inference_input["encoder_tokens"]
        decoder_tokens = inference_input["decoder_tokens"][:, :context_end_position]
        encoder_pad = inference_input["encoder_mask"]  # [b, se]
        b, se = encoder_tokens.shape
        sd = decoder_tokens.shape[1]
        future = torch.ones(sd, sd, dtype=torch.bool, device=decoder_tokens.device).triu(1)
        encoder_mask, decoder_mask, cross_mask = t5_extended_attention_mask([
            encoder_pad[:, None, :].expand(b, se, se),
            future[None].expand(b, sd, sd),
            encoder_pad[:, None, :].expand(b, sd, se),
        ])
        return {
            "encoder_tokens": encoder_tokens,
            "decoder_tokens": decoder_tokens,
            "encoder_mask": encoder_mask,
            "decoder_mask": decoder_mask,
            "encoder_decoder_mask": cross_mask,
        }

    def _forward(self, inference_input: dict[str, Any]) -> torch.Tensor:
        """Logits ``[b, sd, V]`` (gathered over tensor parallelism); no KV cache."""
        logits = self.model(
            inference_input["encoder_tokens"], inference_input["decoder_tokens"], inference_input["encoder_mask"],
            inference_input["decoder_mask"], inference_input["encoder_decoder_mask"], inference_context=None,
        )
        tp_group = getattr(self.inner_model, "tp_group", None)
        if get_pg_size(tp_group) > 1:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits, tp_group)
        return logits
