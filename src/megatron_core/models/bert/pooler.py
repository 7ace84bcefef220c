"""BERT's pooler (Megatron-Core's ``models.bert.pooler.Pooler``).

Takes the hidden state of one token (the ``[CLS]`` position by default), applies a dense layer and
``tanh``. Under sequence parallelism the ``[s/TP, b, h]`` input is first gathered along the sequence,
so every tensor-parallel rank runs the same (replicated) dense layer on the full sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core.device import get_current_device
from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.transformer_config import TransformerConfig
from megatron_core.transformer.utils import get_linear_layer

__all__ = ["Pooler"]


class Pooler(MegatronModule):
    """``tanh(dense(hidden[sequence_index]))``: ``[s, b, h]`` -> ``[b, h]``; ``dense`` is replicated on TP ranks."""

    def __init__(
        self,
        hidden_size: int,
        init_method: Callable[[torch.Tensor], Any],
        config: TransformerConfig,
        sequence_parallel: bool = False,
        *,
        tp_group: Any = None,
    ) -> None:
        super().__init__(config)
        self.dense = get_linear_layer(hidden_size, hidden_size, init_method, config.perform_initialization)
        # Created on the CPU in fp32 like every get_linear_layer; placed like this library's other parameters.
        self.dense.to(device=_init_device(config), dtype=config.params_dtype)
        self.sequence_parallel = sequence_parallel
        self.tp_group = resolve_tp_group(tp_group)

    def forward(self, hidden_states: torch.Tensor, sequence_index: int = 0) -> torch.Tensor:
        """Pool position ``sequence_index`` of ``hidden_states`` ``[s, b, h]`` (``[s/TP, b, h]`` when sequence
        parallel) into ``[b, h]``."""
        if self.sequence_parallel:
            # Each rank uses the whole gathered sequence, so the backward only splits it (no reduce-scatter).
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
            )
        pooled = self.dense(hidden_states[sequence_index, :, :])
        return torch.tanh(pooled)


def _init_device(config: TransformerConfig) -> torch.device:
    return torch.device("cpu") if config.use_cpu_initialization else get_current_device()
