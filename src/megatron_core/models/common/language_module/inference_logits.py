"""The output layer of a language model under an inference context: logits only for the rows generation needs.

The context picks the rows (``select_logit_hidden_states``: a dynamic step's last token per sampled request, say)
from the whole flattened step. Under sequence parallelism each TP rank holds only its slice of the step, so the
slices are gathered first and the output layer then runs without its own sequence gather, as Megatron-Core's
``GPTModel._postprocess`` does for dynamic batching.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.tensor_parallel.mappings import gather_from_sequence_parallel_region

__all__ = ["inference_logit_hidden_states", "inference_output_layer"]


def inference_logit_hidden_states(output_layer: Any, hidden_states: torch.Tensor, inference_context: Any,
                                  tp_group: Any) -> torch.Tensor:
    """The rows of ``hidden_states`` (``[s, b, h]``, this rank's sequence slice when ``output_layer`` is sequence
    parallel) whose logits ``inference_context`` needs, over the whole sequence."""
    if getattr(output_layer, "sequence_parallel", False):
        hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                             group=tp_group)
    return inference_context.select_logit_hidden_states(hidden_states)


def inference_output_layer(output_layer: Any, hidden_states: torch.Tensor, **kwargs: Any) -> Any:
    """``output_layer(hidden_states, **kwargs)`` on rows from :func:`inference_logit_hidden_states` (already the
    whole sequence: a sequence-parallel output layer skips its gather for this call)."""
    if not getattr(output_layer, "sequence_parallel", False):
        return output_layer(hidden_states, **kwargs)
    output_layer.sequence_parallel = False
    try:
        return output_layer(hidden_states, **kwargs)
    finally:
        output_layer.sequence_parallel = True
