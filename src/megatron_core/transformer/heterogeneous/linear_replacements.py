"""A single ``hidden -> hidden`` linear standing in for a block's attention or MLP (Megatron-Core's
``ColumnParallelLinearGathered``).

The weight is split along its output like any column-parallel linear; the output is then made whole again
so that it can join the residual stream: all-gathered over the hidden dim, or, under sequence parallelism,
placed in this rank's hidden slice of a zero tensor and reduce-scattered over the sequence (each rank keeps
its own tokens with every hidden channel). The bias, if any, is added inside (nothing is returned for
bias-dropout-add to add).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.tensor_parallel.layers import ColumnParallelLinear
from megatron_core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["ColumnParallelLinearGathered"]


class ColumnParallelLinearGathered(ColumnParallelLinear):
    """``[s, b, h] -> [s, b, h]`` (``[s/TP, b, h]`` in and out under sequence parallelism); the weight is
    ``[h / TP, h]`` per rank, initialised with ``config.init_method``, with a bias when ``add_bias_linear``."""

    def __init__(self, config: TransformerConfig, *args: Any, tp_group: Any = None, pg_collection: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(
            config.hidden_size, config.hidden_size, config=config, init_method=config.init_method,
            gather_output=False, bias=config.add_bias_linear, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name=kwargs.get("tp_comm_buffer_name"), tp_group=tp_group, pg_collection=pg_collection,
        )

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """``(output, None)``; attention's keyword arguments (mask, rotary embedding, ...) are ignored."""
        if runtime_gather_output or self.gather_output:
            raise ValueError("a linear replacement gathers its output itself: runtime_gather_output must not be set")
        out, _ = super().forward(input_, weight)
        return self._whole_hidden(out), None

    def _whole_hidden(self, out: torch.Tensor) -> torch.Tensor:
        world = get_pg_size(self.tp_group)
        if world == 1:
            return out
        if not self.sequence_parallel:
            return gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        width = out.shape[-1]
        before = get_pg_rank(self.tp_group) * width
        padded = F.pad(out, (before, self.output_size - before - width))
        return reduce_scatter_to_sequence_parallel_region(padded, group=self.tp_group)
