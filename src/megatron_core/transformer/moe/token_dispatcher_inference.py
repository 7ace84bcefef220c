"""Token dispatchers of MoE inference under expert parallelism (Megatron-Core's ``token_dispatcher_inference``).

With dense routing (``InferenceTopKRouter`` under an engine: ``routing_map [tokens, topk]`` of global expert
ids) and experts that take it (``InferenceGroupedMLP``), every rank of the ``tp_ep`` group (expert TP x EP)
all-gathers the tokens, their probabilities and their routing; its experts compute their share for every
gathered token (zero for tokens routed elsewhere; a partial sum under expert TP) and a reduce-scatter over
``tp_ep`` gives each rank the sums for its own tokens.

* :class:`NCCLAllGatherDispatcher` (``inference_moe_token_dispatcher_type='nccl'``) does this with the
  collectives of :mod:`megatron_core.tensor_parallel.mappings` (NCCL on GPU, gloo on CPU). With the class flag
  ``_use_allgather_v`` set, the ranks may hold different token counts (they are all-gathered first);
  otherwise every rank must hold the same count, as under Megatron-Core's decode CUDA graphs.
* :class:`NVLSAllGatherVDispatcher` (``'nvls'``, the config default) needs NVLS symmetric memory, which this
  library does not provide: building its buffers or dispatching raises ``NotImplementedError`` naming it.

Unlike Megatron-Core, whose combine always returns bf16, the combined output keeps the dtype of the tokens
given to the dispatch, and the variable-count path gathers over ``tp_ep`` (Megatron-Core: ``ep``) so that it
agrees with the equal-count path under expert TP.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from megatron_core.device import get_current_device
from megatron_core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["NVLS_REFUSAL", "InferenceAllGatherDispatcherBase", "NCCLAllGatherDispatcher", "NVLSAllGatherVDispatcher",
           "inference_dispatcher_class"]

logger = logging.getLogger(__name__)

NVLS_REFUSAL = ("NVLS symmetric memory (torch.distributed._symmetric_memory multicast buffers with Triton "
                "multimem kernels on NVLink-connected Hopper+ GPUs) is not provided by this library; use "
                "inference_moe_token_dispatcher_type='nccl'")


class InferenceAllGatherDispatcherBase(MoEAllGatherTokenDispatcher):
    """Common base of the inference all-gather dispatchers: the step's valid-token count, shared by all layers.

    ``_valid_tokens_tensor`` (``[1]`` int32) holds the number of tokens gathered this step over all ranks,
    written in place so its address stays fixed; ``_host_valid_tokens_estimate`` is the host's view of it.
    The first MoE layer's dispatcher (``runs_metadata_sync=True``) refreshes both each step.
    """

    _valid_tokens_tensor: torch.Tensor | None = None
    _host_valid_tokens_estimate: int | None = None

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config: TransformerConfig,
                 pg_collection: Any = None, runs_metadata_sync: bool = True) -> None:
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        self._runs_metadata_sync = runs_metadata_sync
        self.topk = config.moe_router_topk
        self._group_size = self.ep_size * self.tp_size

    @classmethod
    def _valid_tokens(cls) -> torch.Tensor | None:
        return cls._valid_tokens_tensor

    @classmethod
    def _get_host_valid_tokens_estimate(cls) -> int | None:
        return cls._host_valid_tokens_estimate

    @classmethod
    def allocate_valid_tokens_tensor(cls, device: torch.device | None = None) -> None:
        """Allocate the shared ``[1]`` int32 valid-token count on ``device`` (default: the current device)."""
        InferenceAllGatherDispatcherBase._valid_tokens_tensor = torch.zeros(
            1, dtype=torch.int32, device=device if device is not None else get_current_device())

    @classmethod
    def _publish_valid_tokens(cls, total: int, device: torch.device) -> None:
        base = InferenceAllGatherDispatcherBase
        if base._valid_tokens_tensor is None or base._valid_tokens_tensor.device != device:
            base.allocate_valid_tokens_tensor(device)
        base._valid_tokens_tensor.fill_(total)
        base._host_valid_tokens_estimate = total

    def update_metadata(self, local_tokens: int) -> None:
        """Refresh the step's metadata from this rank's ``local_tokens`` (each subclass defines it)."""
        raise NotImplementedError(f"{type(self).__name__} does not define update_metadata")

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """``(gathered tokens, None, probs)``: the experts take the dense routing in ``self.routing_map``."""
        return hidden_states, None, probs

    def combine_preprocess(self, expert_output: torch.Tensor) -> torch.Tensor:
        """Nothing to undo: the experts already summed each token's slots."""
        return expert_output


class NCCLAllGatherDispatcher(InferenceAllGatherDispatcherBase):
    """All-gather / reduce-scatter over ``tp_ep`` through the library's collectives (see the module docstring).

    ``_use_allgather_v`` (class-level, default False) lets the ranks hold different token counts; the counts are
    then all-gathered each step by the dispatcher that runs the metadata sync and reused by the others.
    """

    _use_allgather_v: bool = False
    _local_tokens_per_rank: list[int] | None = None

    @classmethod
    def allocate_buffers(cls, device: torch.device | None = None) -> None:
        """Allocate the shared valid-token count (Megatron-Core calls this once, outside any graph capture)."""
        cls.allocate_valid_tokens_tensor(device)

    def update_metadata(self, local_tokens: int) -> None:
        """Publish the step's gathered token count; with ``_use_allgather_v``, all-gather the per-rank counts."""
        cls = NCCLAllGatherDispatcher
        device = get_current_device() if self._valid_tokens() is None else self._valid_tokens().device
        if cls._use_allgather_v:
            count = torch.tensor([local_tokens], dtype=torch.int64, device=device)
            counts = gather_from_sequence_parallel_region(count, group=self.tp_ep_group)
            cls._local_tokens_per_rank = counts.tolist()
            total = sum(cls._local_tokens_per_rank)
        else:
            total = self._group_size * local_tokens
        self._publish_valid_tokens(total, device)

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Gather ``hidden_states [tokens, h]``, ``probs`` and ``self.routing_map`` ``[tokens, topk]`` over ``tp_ep``."""
        self._dispatch_dtype = hidden_states.dtype
        if self._group_size == 1:
            if self._runs_metadata_sync:
                self._publish_valid_tokens(hidden_states.shape[0], hidden_states.device)
            return hidden_states, probs
        if self._runs_metadata_sync:
            self.update_metadata(hidden_states.shape[0])
        splits = self._split_sizes(hidden_states.shape[0])
        with torch.no_grad():
            self.routing_map = gather_from_sequence_parallel_region(self.routing_map, group=self.tp_ep_group,
                                                                    output_split_sizes=splits)
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_ep_group, output_split_sizes=splits)
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.tp_ep_group,
                                                                 output_split_sizes=splits)
        return hidden_states, probs

    def _split_sizes(self, local_tokens: int) -> list[int] | None:
        if not NCCLAllGatherDispatcher._use_allgather_v:
            return None
        counts = NCCLAllGatherDispatcher._local_tokens_per_rank
        if counts is None or len(counts) != self._group_size:
            raise RuntimeError("NCCLAllGatherDispatcher: _use_allgather_v is set but no per-rank token counts were "
                               "gathered this step (the first MoE layer's dispatcher must run the metadata sync)")
        return counts

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Sum the experts' outputs over ``tp_ep`` and keep this rank's tokens, in the dispatched dtype."""
        dtype = getattr(self, "_dispatch_dtype", hidden_states.dtype)
        if self._group_size == 1:
            return hidden_states.to(dtype)
        with torch.no_grad():
            output = reduce_scatter_to_sequence_parallel_region(
                hidden_states, group=self.tp_ep_group,
                input_split_sizes=self._split_sizes(0) if NCCLAllGatherDispatcher._use_allgather_v else None)
        return output.to(dtype)


class NVLSAllGatherVDispatcher(InferenceAllGatherDispatcherBase):
    """Megatron-Core's variable-count NVLS dispatcher: it builds, but needs NVLS symmetric memory to run.

    :meth:`allocate_buffers` and every dispatch or combine with more than one ``tp_ep`` rank raise
    ``NotImplementedError`` naming NVLS symmetric memory and ``inference_moe_token_dispatcher_type='nccl'``;
    with a single rank it passes tokens through.
    """

    @classmethod
    def allocate_buffers(cls, per_rank_worst_case_token_count: int, topk: int, hidden_size: int,
                         ep_group: Any) -> None:
        """Megatron-Core allocates the symmetric AllGather-V / ReduceScatter-V buffers here: refused."""
        raise NotImplementedError(f"NVLSAllGatherVDispatcher.allocate_buffers: {NVLS_REFUSAL}")

    def update_metadata(self, local_tokens: int) -> None:
        """The fused NVLS metadata kernel: refused."""
        raise NotImplementedError(f"NVLSAllGatherVDispatcher.update_metadata: {NVLS_REFUSAL}")

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Pass-through with one ``tp_ep`` rank; otherwise refused (NVLS AllGather-V)."""
        if self._group_size > 1:
            raise NotImplementedError(f"NVLSAllGatherVDispatcher.token_dispatch: {NVLS_REFUSAL}")
        if self._runs_metadata_sync:
            self._publish_valid_tokens(hidden_states.shape[0], hidden_states.device)
        return hidden_states, probs

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Pass-through with one ``tp_ep`` rank; otherwise refused (NVLS ReduceScatter-V)."""
        if self._group_size > 1:
            raise NotImplementedError(f"NVLSAllGatherVDispatcher.token_combine: {NVLS_REFUSAL}")
        return hidden_states


_warned_nvls = False


def inference_dispatcher_class(config: TransformerConfig) -> type[InferenceAllGatherDispatcherBase]:
    """The dispatcher ``config.inference_moe_token_dispatcher_type`` asks for: ``'nccl'`` is
    :class:`NCCLAllGatherDispatcher`; ``'nvls'`` (the default) also gets it, with a one-time warning: NVLS
    symmetric memory is a transport this library does not have, and the all-gather computes the same result
    (``NVLSAllGatherVDispatcher`` itself refuses). Any other value raises ``ValueError``."""
    global _warned_nvls
    kind = config.inference_moe_token_dispatcher_type
    if kind == "nccl":
        return NCCLAllGatherDispatcher
    if kind == "nvls":
        if not _warned_nvls:
            logger.warning("inference_moe_token_dispatcher_type='nvls': NVLS symmetric memory is not available in "
                           "this library; the MoE layers use the NCCL all-gather dispatcher (same results)")
            _warned_nvls = True
        return NCCLAllGatherDispatcher
    raise ValueError(f"inference_moe_token_dispatcher_type ({kind!r}) must be 'nccl' or 'nvls'")
