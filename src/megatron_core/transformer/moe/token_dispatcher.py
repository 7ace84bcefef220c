"""Moving tokens to their experts and back (Megatron-Core's ``MoEAllGatherTokenDispatcher`` / ``MoEAlltoAllTokenDispatcher``).

Groups: ``ep`` (expert parallel), ``expt_tp`` (expert tensor parallel, ETP) and ``tp_ep`` (their
product, ETP fastest). Each rank holds ``num_local_experts`` consecutive experts starting at
``ep_rank * num_local_experts``; expert weights are sharded over ETP, so every ETP rank of an
expert sees all of that expert's tokens and returns a partial sum.

* all-gather: gather tokens, probs and the routing map over ``tp_ep``; keep the local experts'
  rows; after the experts, scatter rows back and reduce-scatter over ``tp_ep`` (summing the ETP
  partials and the other EP ranks' experts).
* all-to-all: permute tokens by expert locally, all-to-all over ``ep`` with per-rank counts,
  all-gather over ETP, regroup the chunks by local expert; the combine runs the inverse steps.

Each dispatcher splits the work into ``dispatch_preprocess -> token_dispatch -> dispatch_postprocess``
and ``combine_preprocess -> token_combine -> combine_postprocess`` as Megatron-Core does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core import config as megatron_core_config
from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.fusions.fused_pad_routing_map import fused_pad_routing_map
from megatron_core.tensor_parallel.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_core.transformer.moe.host_counts import refuse_host_counts_while_capturing
from megatron_core.transformer.moe.moe_utils import (
    get_align_size_for_quantization,
    get_default_pg_collection,
    pad_routing_map,
    padded_expert_capacity,
)
from megatron_core.transformer.moe.token_permutation import (
    permute,
    permute_top_k,
    permute_top_k_aligned,
    sort_chunks_by_idxs,
    unpermute,
    unpermute_top_k,
)
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher", "MoETokenDispatcher"]


def _gather(x: torch.Tensor, group: Any, output_split_sizes: list[int] | None = None) -> torch.Tensor:
    if get_pg_size(group) == 1:
        return x
    return gather_from_sequence_parallel_region(x, group=group, output_split_sizes=output_split_sizes)


def _reduce_scatter(x: torch.Tensor, group: Any, input_split_sizes: list[int] | None = None) -> torch.Tensor:
    if get_pg_size(group) == 1:
        return x
    return reduce_scatter_to_sequence_parallel_region(x, group=group, input_split_sizes=input_split_sizes)


def _all_to_all(group: Any, x: torch.Tensor, output_splits: list[int] | None, input_splits: list[int] | None
                ) -> torch.Tensor:
    if get_pg_size(group) == 1:
        return x
    return all_to_all(group, x, output_splits, input_splits)


def counts_stay_on_device(config: TransformerConfig, tp_ep_group: Any) -> bool:
    """Whether the tokens-per-expert counts can stay on the device (no host sync per layer).

    True when this rank holds every expert (expert-parallel x expert-TP size 1) and each token has exactly
    top-k rows (:func:`rows_are_top_k`). Otherwise the split sizes of the collectives need the counts on the
    host, as in Megatron-Core.
    """
    return get_pg_size(tp_ep_group) == 1 and rows_are_top_k(config)


def rows_are_top_k(config: TransformerConfig) -> bool:
    """Whether every token is dispatched to exactly top-k rows: no token dropped by a capacity factor and no
    zero-probability route added by ``moe_router_padding_for_quantization``."""
    return config.moe_expert_capacity_factor is None and not config.moe_router_padding_for_quantization


class MoETokenDispatcher:
    """Base dispatcher: holds the groups and their sizes."""

    def __init__(self, config: TransformerConfig, pg_collection: Any = None) -> None:
        pgs = get_default_pg_collection(pg_collection)
        self.config = config
        self.shared_experts = None
        self.ep_group, self.tp_group, self.tp_ep_group = pgs.ep, pgs.expt_tp, pgs.tp_ep
        self.tp_size, self.tp_rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        self.ep_size, self.ep_rank = get_pg_size(self.ep_group), get_pg_rank(self.ep_group)
        # The experts' wish for their input rows (an extension, set by MoELayer): given the tokens, the alignment
        # of group starts that their grouped GEMM needs, or None. Where this rank permutes the tokens for its
        # own experts, the rows then come laid out that way (an AlignedRows in place of tokens_per_expert).
        self.expert_row_alignment: Callable[[torch.Tensor], int | None] | None = None

    def _row_alignment(self, tokens: torch.Tensor) -> int | None:
        return None if self.expert_row_alignment is None else self.expert_row_alignment(tokens)

    def set_shared_experts(self, shared_experts: Any) -> None:
        """Register the shared experts for overlap (run un-overlapped by this library)."""
        self.shared_experts = shared_experts


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """All-gather tokens over ``tp_ep``, compute the local experts, reduce-scatter the results."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config: TransformerConfig,
                 pg_collection: Any = None) -> None:
        super().__init__(config, pg_collection)
        if num_local_experts <= 0 or len(local_expert_indices) != num_local_experts:
            raise ValueError(f"need num_local_experts ({num_local_experts}) > 0 local expert indices, "
                             f"got {local_expert_indices}")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.router_topk = config.moe_router_topk
        self.counts_stay_on_device = counts_stay_on_device(config, self.tp_ep_group)
        self.token_rows: torch.Tensor | None = None  # [T, k] rows of each token, when every token has k rows

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Flatten ``[s, b, h]`` to ``[s * b, h]`` and keep the routing map."""
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        return hidden_states.view(-1, self.hidden_shape[-1]), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """All-gather tokens, probs and routing map over ``tp_ep``."""
        if get_pg_size(self.tp_ep_group) > 1:
            with torch.no_grad():
                self.routing_map = _gather(self.routing_map.to(torch.uint8), self.tp_ep_group).bool()
            probs = _gather(probs, self.tp_ep_group)
            hidden_states = _gather(hidden_states, self.tp_ep_group)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """``(tokens of the local experts grouped by expert, tokens_per_expert, their probs)``."""
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()
        local_probs = probs[:, first:last]
        tokens_per_expert = self.local_map.sum(dim=0).long()
        self.token_rows = None
        alignment = self._row_alignment(hidden_states) if self.counts_stay_on_device else None
        if alignment is not None:  # top-k rows per token, written straight into the experts' layout
            (permuted, permuted_probs, self.reversed_local_input_permutation_mapping, self.token_rows,
             tokens_per_expert) = permute_top_k_aligned(hidden_states, self.local_map, self.router_topk, alignment,
                                                        probs=local_probs)
        elif self.counts_stay_on_device:  # every token has exactly top-k rows: gathers only
            permuted, permuted_probs, self.reversed_local_input_permutation_mapping, self.token_rows = permute_top_k(
                hidden_states, self.local_map, self.router_topk, probs=local_probs)
        elif self.config.moe_pad_expert_input_to_capacity:
            # Every rank's router padded each expert to the same count: the rows follow from the shapes, so the
            # counts stay on the device (and a compiled layer stays one graph).
            rows = self._padded_rows_per_expert(hidden_states.shape[0]) * self.num_local_experts
            permuted, permuted_probs, self.reversed_local_input_permutation_mapping = permute(
                hidden_states, self.local_map, probs=local_probs, num_out_tokens=rows, drop_and_pad=True)
        else:
            refuse_host_counts_while_capturing(tokens_per_expert, "MoEAllGatherTokenDispatcher (host-sized permute)")
            tokens_per_expert = tokens_per_expert.cpu()
            permuted, permuted_probs, self.reversed_local_input_permutation_mapping = permute(
                hidden_states, self.local_map, probs=local_probs, num_out_tokens=int(tokens_per_expert.sum()))
        self.routing_map = None
        return permuted, tokens_per_expert, permuted_probs

    def _padded_rows_per_expert(self, gathered_tokens: int) -> int:
        """Rows of each expert gathered from the ranks whose routers each padded it to capacity."""
        ranks = get_pg_size(self.tp_ep_group)
        return ranks * padded_expert_capacity(gathered_tokens // ranks, self.router_topk, self.config.num_moe_experts,
                                              self.config.moe_expert_capacity_factor)

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Sum the expert rows back into the gathered token order."""
        if self.token_rows is not None:
            return unpermute_top_k(hidden_states, self.reversed_local_input_permutation_mapping, self.token_rows)
        return unpermute(hidden_states, self.reversed_local_input_permutation_mapping,
                         restore_shape=self.hidden_shape_before_permute)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Reduce-scatter over ``tp_ep``: each rank gets its own tokens, summed over experts and ETP."""
        return _reduce_scatter(hidden_states, self.tp_ep_group)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Restore ``[s, b, h]``."""
        return hidden_states.view(self.hidden_shape)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """Permute locally, all-to-all over ``ep``, all-gather over ETP; the combine inverts each step."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config: TransformerConfig,
                 pg_collection: Any = None) -> None:
        super().__init__(config, pg_collection)
        if num_local_experts <= 0 or len(local_expert_indices) != num_local_experts or any(
                b - a != 1 for a, b in zip(local_expert_indices, local_expert_indices[1:])):
            raise ValueError(f"local_expert_indices ({local_expert_indices}) must be {num_local_experts} "
                             "consecutive expert indices")
        self.num_local_experts = num_local_experts
        self.num_experts = config.num_moe_experts
        self.local_expert_indices = local_expert_indices
        chunks = torch.arange(self.num_experts * self.tp_size)
        self.sort_input_by_local_experts = chunks.reshape(-1, num_local_experts).T.ravel().tolist()
        self.restore_output_by_local_experts = chunks.reshape(num_local_experts, -1).T.ravel().tolist()
        self.drop_and_pad = config.moe_pad_expert_input_to_capacity
        self.capacity: int | None = None
        self.input_splits = self.output_splits = self.output_splits_tp = None
        self.counts_stay_on_device = counts_stay_on_device(config, self.tp_ep_group)
        self.token_rows: torch.Tensor | None = None  # [T, k] rows of each token, when every token has k rows

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Compute the all-to-all split sizes; returns the tokens per local expert (over all ranks)."""
        if self.drop_and_pad:
            # The router's padded map holds this many rows per expert (all tokens when the capacity exceeds them).
            self.capacity = padded_expert_capacity(routing_map.size(0), self.config.moe_router_topk, self.num_experts,
                                                   self.config.moe_expert_capacity_factor)
            self.num_out_tokens = self.capacity * self.num_experts
            per_rank = self.capacity * self.num_local_experts
            self.input_splits = [per_rank] * self.ep_size
            self.output_splits = [per_rank] * self.ep_size
            self.output_splits_tp = [per_rank * self.ep_size] * self.tp_size
            return torch.full((self.num_local_experts,), self.capacity * self.tp_size * self.ep_size, dtype=torch.long)
        local_counts = routing_map.sum(dim=0).long()
        if self.counts_stay_on_device:
            # One rank holds every expert and no token is dropped: each token has exactly top-k rows, so
            # nothing about the shapes depends on the routing and the counts never leave the device.
            self.num_out_tokens = routing_map.shape[0] * self.config.moe_router_topk
            self.num_global_tokens_per_local_expert = local_counts.reshape(1, -1)
            return local_counts
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        # One device-to-host copy of every count this step needs.
        refuse_host_counts_while_capturing(local_counts, "MoEAlltoAllTokenDispatcher (host-sized all-to-all splits)")
        if get_pg_size(self.tp_ep_group) > 1:
            gathered = _gather(local_counts, self.tp_ep_group).cpu()
            global_counts = gathered.reshape(self.ep_size, self.tp_size, self.num_experts).transpose(0, 1)
            local_cpu = gathered.reshape(self.ep_size, self.tp_size, self.num_experts)[self.ep_rank, self.tp_rank]
        else:
            local_cpu = local_counts.cpu()
            global_counts = local_cpu.reshape(1, 1, self.num_experts)
        self.num_out_tokens = int(local_cpu.sum())
        self.input_splits = local_cpu.reshape(self.ep_size, self.num_local_experts).sum(dim=1).tolist()
        per_local = global_counts[:, :, first:last].contiguous()  # [tp, ep, local experts]
        per_rank = per_local.sum(dim=2)
        self.output_splits = per_rank[self.tp_rank].tolist()
        self.output_splits_tp = per_rank.sum(dim=1).tolist()
        self.num_global_tokens_per_local_expert = per_local.reshape(-1, self.num_local_experts)
        return per_local.sum(dim=(0, 1))

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Flatten and permute tokens (and probs) by expert."""
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map  # (the probs are not kept: held, they would keep the step's autograd graph)
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        if self.config.moe_router_padding_for_quantization:
            # Zero-probability routes fill each expert to the FP8 row alignment (Megatron-Core pads here too).
            fused = self.config.moe_permute_fusion and megatron_core_config.ENABLE_EXPERIMENTAL  # as Megatron-Core
            pad = fused_pad_routing_map if fused else pad_routing_map
            routing_map = self.routing_map = pad(routing_map, get_align_size_for_quantization(self.config)).bool()
        self.tokens_per_expert = self.preprocess(routing_map)
        self.hidden_shape_before_permute = hidden_states.shape
        self.token_rows = None
        alignment = (self._row_alignment(hidden_states)
                     if self.counts_stay_on_device and self.tp_size * self.ep_size == 1 else None)
        if alignment is not None:
            # This rank's own experts get every row: written straight into their layout (no exchange between).
            (permuted, permuted_probs, self.reversed_local_input_permutation_mapping, self.token_rows,
             self.tokens_per_expert) = permute_top_k_aligned(hidden_states, routing_map, self.config.moe_router_topk,
                                                             alignment, probs=probs)
        elif rows_are_top_k(self.config):
            # Nothing is dropped, so every token has exactly top-k rows: gathers only.
            permuted, permuted_probs, self.reversed_local_input_permutation_mapping, self.token_rows = permute_top_k(
                hidden_states, routing_map, self.config.moe_router_topk, probs=probs)
        else:
            permuted, permuted_probs, self.reversed_local_input_permutation_mapping = permute(
                hidden_states, routing_map, probs=probs, num_out_tokens=self.num_out_tokens,
                drop_and_pad=self.drop_and_pad)
        return permuted, permuted_probs

    def token_dispatch(self, permutated_local_input_tokens: torch.Tensor, permuted_probs: torch.Tensor):
        """All-to-all over ``ep``: each rank receives the tokens of its local experts."""
        tokens = _all_to_all(self.ep_group, permutated_local_input_tokens, self.output_splits, self.input_splits)
        probs = _all_to_all(self.ep_group, permuted_probs, self.output_splits, self.input_splits)
        return tokens, probs

    def _regroup(self, x: torch.Tensor, to_expert_major: bool) -> torch.Tensor:
        lead = (self.tp_size * self.ep_size, self.num_local_experts) if to_expert_major else (
            self.num_local_experts, self.tp_size * self.ep_size)
        return x.view(*lead, self.capacity, *x.shape[1:]).transpose(0, 1).contiguous().flatten(0, 2)

    def dispatch_postprocess(self, global_input_tokens: torch.Tensor, global_probs: torch.Tensor):
        """All-gather over ETP and sort the chunks by local expert."""
        if self.tp_size > 1:
            global_input_tokens = _gather(global_input_tokens, self.tp_group, self.output_splits_tp)
            global_probs = _gather(global_probs, self.tp_group, self.output_splits_tp)
        if self.num_local_experts > 1 and self.tp_size * self.ep_size > 1:  # one source rank: already sorted
            if self.drop_and_pad:
                global_input_tokens = self._regroup(global_input_tokens, True)
                global_probs = self._regroup(global_probs, True)
            else:
                global_input_tokens, global_probs = sort_chunks_by_idxs(
                    global_input_tokens, self.num_global_tokens_per_local_expert.ravel(),
                    self.sort_input_by_local_experts, probs=global_probs)
        return global_input_tokens, self.tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Undo the chunk sort and reduce-scatter over ETP."""
        if self.num_local_experts > 1 and self.tp_size * self.ep_size > 1:
            if self.drop_and_pad:
                hidden_states = self._regroup(hidden_states, False)
            else:
                hidden_states, _ = sort_chunks_by_idxs(
                    hidden_states, self.num_global_tokens_per_local_expert.T.ravel(),
                    self.restore_output_by_local_experts)
        if self.tp_size > 1:
            hidden_states = _reduce_scatter(hidden_states, self.tp_group, self.output_splits_tp)
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The inverse all-to-all over ``ep``."""
        return _all_to_all(self.ep_group, hidden_states, self.input_splits, self.output_splits)

    def combine_postprocess(self, permutated_local_input_tokens: torch.Tensor) -> torch.Tensor:
        """Sum each token's expert rows back and restore ``[s, b, h]``."""
        if self.token_rows is not None:
            output = unpermute_top_k(permutated_local_input_tokens, self.reversed_local_input_permutation_mapping,
                                     self.token_rows)
        else:
            output = unpermute(permutated_local_input_tokens, self.reversed_local_input_permutation_mapping,
                               restore_shape=self.hidden_shape_before_permute)
        return output.view(self.hidden_shape)
