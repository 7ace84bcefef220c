"""A Hugging Face Qwen2 causal language model as a ``MegatronModule`` (Megatron-Core's ``QwenHuggingFaceModel``).

The language model of a LLaVA-style model: it takes the combined text and image embeddings in Megatron's
``[s, b, h]`` layout (``decoder_input``), runs ``Qwen2ForCausalLM`` on them (batch first, positions
``0..s-1``) and returns the per-token cross-entropy ``[b, s]`` when labels are given, else the model's output
(``logits`` ``[b, s, vocab]``). ``embedding`` gives the token embeddings in ``[s, b, h]``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.models.huggingface._base import HuggingFaceModule
from megatron_core.models.huggingface._optional import (
    HAVE_TRANSFORMERS,
    TransformersClasses,
    transformers_attr,
)

__all__ = ["HAVE_TRANSFORMERS", "QwenHuggingFaceModel"]


class QwenHuggingFaceModel(HuggingFaceModule):
    """``Qwen2ForCausalLM`` loaded from ``config.language_model_type`` (``"hf://<name or directory>"``)."""

    # Units FSDP2 (``TorchFullyShardedDataParallel``) shards one by one: the decoder layers.
    _fsdp_modules = TransformersClasses("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer")

    def __init__(self, config: Any) -> None:
        causal_lm = transformers_attr("transformers.models.qwen2", "Qwen2ForCausalLM", "QwenHuggingFaceModel")
        super().__init__(config)
        self.model = causal_lm.from_pretrained(config.language_model_type.split("hf://")[1])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run on ``decoder_input`` ``[s, b, h]`` (keyword; positional arguments are ignored).

        ``attention_mask`` goes to the model unchanged (``None``: causal). With ``labels`` ``[b, s]`` the result
        is the unreduced cross-entropy ``[b, s]`` (label -100 gives 0); with ``labels=None`` it is the model's
        output, whose ``"logits"`` are ``[b, s, vocab]``.
        """
        if kwargs.get("decoder_input") is None:
            raise ValueError("QwenHuggingFaceModel.forward needs decoder_input= (the [s, b, h] input embeddings); "
                             "compute it with .embedding(input_ids)")
        labels = kwargs.get("labels")
        output = self.model(position_ids=None, attention_mask=kwargs.get("attention_mask"),
                            inputs_embeds=kwargs["decoder_input"].permute(1, 0, 2))
        if labels is None:
            return output
        logits = output["logits"]  # [b, s, vocab]
        return torch.nn.functional.cross_entropy(logits.permute(0, 2, 1), labels, reduction="none")

    def embedding(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The token embeddings of ``input_ids`` ``[b, s]`` as ``[s, b, h]`` (``position_ids`` unused: RoPE is
        applied inside the layers)."""
        return self.model.get_input_embeddings()(input_ids).transpose(1, 0).contiguous()
