"""BERT's masked-language-model head (Megatron-Core's ``models.bert.bert_lm_head.BertLMHead``).

``layer_norm(gelu(dense(hidden)))`` on ``[s, b, h]``; the projection onto the vocabulary is the
model's ``output_layer`` (tied to the word embeddings when asked), not part of this module. The dense
layer is replicated on tensor-parallel ranks; under sequence parallelism each rank sees its own
tokens, so its parameters are marked ``sequence_parallel`` and their gradients are summed over the
TP group by ``finalize_model_grads``, as for the norms.
"""

from __future__ import annotations

import torch

from megatron_core.device import get_current_device
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from megatron_core.transformer.transformer_config import TransformerConfig
from megatron_core.transformer.utils import get_linear_layer

__all__ = ["BertLMHead"]


class BertLMHead(MegatronModule):
    """Dense ``h -> h``, exact (erf) GeLU, then the config's norm (``config.normalization``)."""

    def __init__(self, hidden_size: int, config: TransformerConfig) -> None:
        super().__init__(config=config)
        self.dense = get_linear_layer(hidden_size, hidden_size, config.init_method, config.perform_initialization)
        # Created on the CPU in fp32 like every get_linear_layer; placed like this library's other parameters.
        self.dense.to(device=_init_device(config), dtype=config.params_dtype)
        self.dense.weight.sequence_parallel = config.sequence_parallel
        self.dense.bias.sequence_parallel = config.sequence_parallel
        self.layer_norm = WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=config.layernorm_epsilon)
        self.gelu = torch.nn.functional.gelu

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]``."""
        return self.layer_norm(self.gelu(self.dense(hidden_states)))


def _init_device(config: TransformerConfig) -> torch.device:
    return torch.device("cpu") if config.use_cpu_initialization else get_current_device()
