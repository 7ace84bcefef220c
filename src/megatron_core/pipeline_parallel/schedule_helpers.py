"""Small helpers Megatron-Core's ``pipeline_parallel.schedules`` exports beside its schedules.

- :func:`get_pp_rank_microbatches`: how many micro-batches a stage runs in warm-up and in steady 1F1B;
- :func:`get_tensor_device`: the device of a tensor or of a dict of tensors;
- :func:`clear_embedding_activation_buffer` / :func:`finish_embedding_wgrad_compute`: the last stage's
  deferred output-layer weight gradient (``defer_embedding_wgrad_compute``). This library's ``GPTModel``
  gives its output layer no buffers (the gradient is formed in each micro-batch's backward), so for it both
  are no-ops; a model that hands ``embedding_activation_buffer`` / ``grad_output_buffer`` lists to its
  output ``ColumnParallelLinear`` gets its weight gradient here, after the last backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core._wrapped_model import get_attr_wrapped_model
from megatron_core.tensor_parallel.deferred_wgrad import drain_embedding_wgrad_compute

__all__ = [
    "clear_embedding_activation_buffer",
    "finish_embedding_wgrad_compute",
    "get_pp_rank_microbatches",
    "get_tensor_device",
]


def get_tensor_device(tensor: torch.Tensor | dict[str, torch.Tensor]) -> torch.device:
    """``tensor.device``, or the device of the first value of a dict of tensors."""
    if isinstance(tensor, dict):
        return next(iter(tensor.values())).device
    return tensor.device


def get_pp_rank_microbatches(
    num_microbatches: int,
    num_model_chunks: int,
    microbatch_group_size_per_vp_stage: int,
    forward_only: bool = False,
    overlap_moe_expert_parallel_comm: bool = False,
    p2p_communicator: Any = None,
) -> tuple[int, bool, int, int]:
    """``(total, all_in_warmup, num_warmup, num_remaining)`` micro-batches of this pipeline stage.

    ``total = num_microbatches * num_model_chunks``. Warm-up forwards: all of them when ``forward_only``;
    ``pp - rank - 1`` without interleaving; ``2 * (pp - rank - 1) + (chunks - 1) * group`` with it (plus one
    with ``overlap_moe_expert_parallel_comm``); none for one stage. Capped at ``total`` (``all_in_warmup``).
    The pipeline size and rank come from ``p2p_communicator.pp_group`` when given, else ``parallel_state``.
    """
    if p2p_communicator is not None:
        pp_group = p2p_communicator.pp_group
        pp_size, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        vp_size = getattr(p2p_communicator, "virtual_pipeline_model_parallel_size",
                          getattr(getattr(p2p_communicator, "config", None),
                                  "virtual_pipeline_model_parallel_size", None))
    else:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()

    total = num_microbatches * num_model_chunks
    if forward_only:
        num_warmup = total
    elif pp_size > 1 and vp_size is None:
        num_warmup = pp_size - pp_rank - 1
    elif pp_size > 1:
        num_warmup = 2 * (pp_size - pp_rank - 1) + (num_model_chunks - 1) * microbatch_group_size_per_vp_stage
        num_warmup += 1 if overlap_moe_expert_parallel_comm else 0
    else:
        num_warmup = 0
    all_in_warmup = num_warmup >= total
    num_warmup = min(num_warmup, total)
    return total, all_in_warmup, num_warmup, total - num_warmup


def clear_embedding_activation_buffer(config: Any, model: Any, is_last_stage: bool) -> Any:
    """On the last stage with ``defer_embedding_wgrad_compute``: empty the output layer's activation buffer
    (no stale activations from an earlier step) and return the module holding it; ``None`` elsewhere.

    ``model`` is one model chunk or the list of chunks (the last chunk holds the output layer).
    """
    if not (is_last_stage and config.defer_embedding_wgrad_compute):
        return None
    chunk = model[-1] if isinstance(model, list) else model
    embedding_module = get_attr_wrapped_model(chunk, "post_process", return_model_obj=True)
    buffer = getattr(embedding_module, "embedding_activation_buffer", None)
    if buffer is not None:
        buffer.clear()
    return embedding_module


def finish_embedding_wgrad_compute(config: Any, embedding_module: Any, is_last_stage: bool,
                                   tp_group: dist.ProcessGroup | None) -> None:
    """On the last stage with ``defer_embedding_wgrad_compute``: add the deferred output-layer weight gradient
    (:func:`~megatron_core.tensor_parallel.deferred_wgrad.drain_embedding_wgrad_compute`). A module without
    buffers (this library's ``GPTModel``) has nothing deferred."""
    if not (is_last_stage and config.defer_embedding_wgrad_compute) or embedding_module is None:
        return
    activations = getattr(embedding_module, "embedding_activation_buffer", None)
    grad_outputs = getattr(embedding_module, "grad_output_buffer", None)
    if not activations and not grad_outputs:
        return
    if hasattr(embedding_module, "shared_embedding_or_output_weight"):
        weight = embedding_module.shared_embedding_or_output_weight()
    else:
        weight = embedding_module.output_layer.weight
    drain_embedding_wgrad_compute(config, activations or [], grad_outputs or [], weight, tp_group)
