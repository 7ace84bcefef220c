"""Shapes of a dynamic-inference step and the CUDA-graph shapes made for them (Megatron-Core's
``inference.batch_dimensions_utils``).

:class:`InferenceBatchDimensions` describes a step by three counts: tokens fed, prefill requests and
decode requests. :class:`CUDAGraphBatchDimensionBuilder` turns the CUDA-graph settings of an
``InferenceConfig`` (``num_cuda_graphs``, ``cuda_graph_max_tokens``, ``cuda_graph_mixed_prefill_count``,
``cuda_graph_sizing_distribution``) and the TP size into the list of shapes to capture, and picks for a real
step the smallest captured shape that holds it (or none: the step runs eagerly).

This library's dynamic context does not capture by these rules: its decode graphs are keyed by padded
request count (``contexts.decode_graph_inputs.graph_batch_sizes``), which agrees with the list made here only
for ``LINEAR`` sizing with ``num_cuda_graphs=-1`` at TP 1 (docs/compat.md). Megatron-Core's asserts are
``ValueError``s here, naming the fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from megatron_core._ground.groups import get_pg_size
from megatron_core._misc_utils import round_up_to_nearest_multiple
from megatron_core.inference.config import CudaGraphSizingDistribution

__all__ = ["CUDAGraphBatchDimensionBuilder", "InferenceBatchDimensions"]


@dataclass(order=True, frozen=True)
class InferenceBatchDimensions:
    """Token count, prefill request count and decode request count of one step (or of one CUDA graph).

    Instances compare as the tuple ``(token_count, prefill_req_count, decode_req_count)``, so ``min`` of a list
    of graphs is the one with the fewest tokens; they hash by the same tuple.
    """

    token_count: int = 0
    prefill_req_count: int = 0
    decode_req_count: int = 0

    def __str__(self) -> str:
        """``"[tokens]: P P + D D"``, e.g. ``"[64]: 2 P + 30 D"``."""
        return f"[{self.token_count}]: {self.prefill_req_count} P + {self.decode_req_count} D"

    @property
    def req_count(self) -> int:
        """Prefill plus decode requests."""
        return self.prefill_req_count + self.decode_req_count

    def is_applicable_for_batch_dim(self, real_batch_dim: InferenceBatchDimensions, strict: bool = False) -> bool:
        """Whether a graph of these dimensions can run the step ``real_batch_dim`` (padding the rest).

        It needs at least the step's tokens. A decode-only step needs a decode-only graph with enough decode
        slots. A step with prefills needs enough prefill slots and, when ``strict``, enough decode slots;
        otherwise spare prefill slots may hold decode requests, so the total request count is what must fit.
        """
        if self.token_count < real_batch_dim.token_count:
            return False
        if real_batch_dim.prefill_req_count == 0:
            return self.prefill_req_count == 0 and self.decode_req_count >= real_batch_dim.decode_req_count
        if self.prefill_req_count < real_batch_dim.prefill_req_count:
            return False
        if strict:
            return self.decode_req_count >= real_batch_dim.decode_req_count
        return self.req_count >= real_batch_dim.req_count

    def is_valid(self, max_requests: int, max_sequence_length: int, num_speculative_tokens: int) -> bool:
        """Whether a step of these dimensions can exist under the context's limits.

        It needs tokens, non-negative counts, at most ``max_requests`` requests, and a token count between the
        fewest its requests can feed (one per prefill, ``num_speculative_tokens + 1`` per decode) and the most
        (``max_sequence_length`` per prefill).
        """
        rows = num_speculative_tokens + 1
        prefill, decode, tokens = self.prefill_req_count, self.decode_req_count, self.token_count
        if tokens <= 0 or prefill < 0 or decode < 0 or prefill + decode > max_requests:
            return False
        return prefill + decode * rows <= tokens <= prefill * max_sequence_length + decode * rows

    @staticmethod
    def adjust_batch_dims_for_expert_parallelism(
        local_batch_dims: InferenceBatchDimensions, ep_group: Any = None, ep_zmq_communicator: Any = None,
    ) -> InferenceBatchDimensions | None:
        """The dimensions every rank of ``ep_group`` should match a graph with, or None to run eagerly.

        Expert-parallel ranks exchange tokens inside each MoE layer, so they must replay graphs of one token
        count. The ranks take the maximum of their token counts and of a has-prefill flag: if any rank has a
        prefill, all return None (eager mode); otherwise each keeps its own request counts with the largest
        token count. ``ep_group=None`` or a group of one rank returns ``local_batch_dims`` unchanged.
        ``ep_zmq_communicator`` (an ``AsyncZMQCommunicator`` over the EP ranks) does the reduction on the host
        through its ``sync_all_reduce_max``; without it a ``torch.distributed`` all-reduce runs on the group's
        device (CUDA for NCCL, the CPU for gloo).
        """
        if get_pg_size(ep_group) <= 1:
            return local_batch_dims
        has_prefill = int(local_batch_dims.prefill_req_count > 0)
        if ep_zmq_communicator is not None:
            max_tokens, any_prefill = ep_zmq_communicator.sync_all_reduce_max(local_batch_dims.token_count,
                                                                               has_prefill)
        else:
            both = torch.tensor([local_batch_dims.token_count, has_prefill], dtype=torch.int64,
                                device=_group_device(ep_group))
            torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=ep_group)
            max_tokens, any_prefill = both.tolist()
        if any_prefill:
            return None
        return InferenceBatchDimensions(int(max_tokens), local_batch_dims.prefill_req_count,
                                        local_batch_dims.decode_req_count)


def _group_device(group: Any) -> torch.device:
    """Where a collective on ``group`` takes its tensors (``torch.cuda`` is asked only for an NCCL group)."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _distribution(value: Any) -> CudaGraphSizingDistribution:
    """``sizing_distribution`` as the enum (None is ``EXPONENTIAL``); a ``ValueError`` for unknown values."""
    if value is None:
        return CudaGraphSizingDistribution.EXPONENTIAL
    try:
        return CudaGraphSizingDistribution(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in CudaGraphSizingDistribution)
        raise ValueError(f"sizing_distribution ({value!r}) must be one of {allowed}") from None


def _check_graph_count(num_cuda_graphs: int, cuda_graph_max_tokens: int) -> None:
    if num_cuda_graphs < 1:
        raise ValueError(f"num_cuda_graphs ({num_cuda_graphs}) must be >= 1, or -1 to choose the count")
    if cuda_graph_max_tokens <= 0:
        raise ValueError(f"cuda_graph_max_tokens ({cuda_graph_max_tokens}) must be > 0")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} ({value}) must be >= 1")


class CUDAGraphBatchDimensionBuilder:
    """Generates the CUDA-graph batch dimensions of a context and matches steps to them (static methods)."""

    CUDA_GRAPH_ROUNDER = 2
    """Graph token counts are kept even (before TP alignment)."""

    @staticmethod
    def _calculate_cuda_graph_token_counts(
        tp_size: int, num_cuda_graphs: int, cuda_graph_max_tokens: int,
        sizing_distribution: CudaGraphSizingDistribution | str | None = None,
    ) -> list[int]:
        """Graph token counts, descending, at most ``num_cuda_graphs`` of them (``-1``: as many as the rule gives).

        ``EXPONENTIAL`` (the default): ``cuda_graph_max_tokens`` rounded down to a multiple of ``tp_size``, then
        halved again and again, each value rounded down to an even number (at least 2) and up to a multiple of
        ``tp_size``; ``tp_size`` itself is always included; when that gives more than ``num_cuda_graphs``
        counts, the smallest ones but ``tp_size`` are dropped. ``-1`` asks for ``max(4, log2(max) + 2)`` halvings.
        ``LINEAR``: see :meth:`_calculate_token_counts_linear`.
        For ``tp_size=1, num_cuda_graphs=8, cuda_graph_max_tokens=128``: ``[128, 64, 32, 16, 8, 4, 2, 1]``.
        """
        if _distribution(sizing_distribution) is CudaGraphSizingDistribution.LINEAR:
            return CUDAGraphBatchDimensionBuilder._calculate_token_counts_linear(
                tp_size, num_cuda_graphs, cuda_graph_max_tokens)
        _check_positive(tp_size=tp_size)
        if num_cuda_graphs == -1:
            num_cuda_graphs = max(4, int(math.log2(max(2, cuda_graph_max_tokens))) + 2)
        _check_graph_count(num_cuda_graphs, cuda_graph_max_tokens)
        rounder = CUDAGraphBatchDimensionBuilder.CUDA_GRAPH_ROUNDER
        top = cuda_graph_max_tokens // tp_size * tp_size
        if num_cuda_graphs == 1:
            return [top]
        sizes = {top, tp_size}
        value = top
        for _ in range(num_cuda_graphs):
            sizes.add(round_up_to_nearest_multiple(max(rounder, value // rounder * rounder), tp_size))
            value //= 2
            if value < 1:
                break
        counts = sorted(sizes, reverse=True)
        if len(counts) > num_cuda_graphs:  # keep the largest ones and the smallest (tp_size)
            counts = counts[: num_cuda_graphs - 1] + counts[-1:]
        return counts

    @staticmethod
    def _calculate_token_counts_linear(tp_size: int, num_cuda_graphs: int, cuda_graph_max_tokens: int) -> list[int]:
        """``LINEAR`` graph token counts, descending.

        ``num_cuda_graphs=-1``: 1, 2, 4, every multiple of 8 below 256 and every multiple of 16 from 256, each
        rounded up to a multiple of ``tp_size`` (repeats dropped), those up to ``cuda_graph_max_tokens``, and
        ``cuda_graph_max_tokens`` itself. ``N >= 1``: multiples of a step of about ``max / N`` (even, a multiple
        of ``tp_size``) below ``max`` rounded down to a multiple of ``tp_size``, and that maximum.
        """
        _check_positive(tp_size=tp_size)
        if num_cuda_graphs == -1:
            ladder = [1, 2, 4, *range(8, 256, 8), *range(256, cuda_graph_max_tokens + 1, 16)]
            aligned = dict.fromkeys(round_up_to_nearest_multiple(s, tp_size) for s in ladder)
            sizes = [s for s in aligned if s <= cuda_graph_max_tokens]
            if not sizes or sizes[-1] != cuda_graph_max_tokens:
                sizes.append(cuda_graph_max_tokens)
            return sizes[::-1]
        _check_graph_count(num_cuda_graphs, cuda_graph_max_tokens)
        rounder = CUDAGraphBatchDimensionBuilder.CUDA_GRAPH_ROUNDER
        step = rounder * math.ceil((cuda_graph_max_tokens // num_cuda_graphs) / rounder)
        step = max(round_up_to_nearest_multiple(step, tp_size), tp_size)
        top = cuda_graph_max_tokens // tp_size * tp_size
        if num_cuda_graphs == 1:
            return [top]
        return [top, *range(step, top, step)[::-1]]

    @staticmethod
    def generate_cuda_graph_batch_dimensions_list(
        tp_size: int,
        num_cuda_graphs: int | None,
        cuda_graph_max_tokens: int | None,
        cuda_graph_mixed_prefill_request_count: int | None,
        max_requests: int,
        max_tokens: int,
        max_sequence_length: int,
        use_cuda_graphs_for_non_decode_steps: bool,
        num_speculative_tokens: int = 0,
        sizing_distribution: CudaGraphSizingDistribution | str | None = None,
    ) -> tuple[list[InferenceBatchDimensions], list[int] | None]:
        """The batch dimensions to capture, and their distinct token counts (descending; None when there are none).

        ``num_cuda_graphs=None`` means no graphs: ``([], None)``. Otherwise ``cuda_graph_max_tokens`` (None, <= 0
        or above ``max_tokens``: ``max_tokens``) must be at least ``max_requests * (num_speculative_tokens + 1)``;
        ``num_cuda_graphs`` is clamped to ``[1, cuda_graph_max_tokens]`` unless it is ``-1`` (size automatically).
        Token counts come from :meth:`_calculate_cuda_graph_token_counts`, once up to ``cuda_graph_max_tokens``
        (prefill and mixed graphs) and once up to ``max_requests * (num_speculative_tokens + 1)`` (decode-only
        graphs; with ``-1`` also one and two of the smallest decode shapes a multiple of both ``tp_size`` and
        ``num_speculative_tokens + 1``).

        Every decode count ``S`` gives a decode-only graph of ``min(S // (k + 1), max_requests)`` requests
        (tokens rounded down to a multiple of ``tp_size``). When ``use_cuda_graphs_for_non_decode_steps`` and
        ``cuda_graph_mixed_prefill_request_count > 0``, every prefill count ``S >= 2`` also gives, for each
        prefill count ``P`` (``EXPONENTIAL``: 1, 2, 4, ... and ``max_requests``; ``LINEAR``: the configured count),
        a mixed graph of ``P`` prefills and as many decodes as the tokens and ``max_requests`` allow, and a
        prefill-only graph. Shapes failing :meth:`InferenceBatchDimensions.is_valid` are dropped; the rest are
        sorted by prefill tokens (``token_count - decode tokens``), then decode count, both descending.
        """
        if num_cuda_graphs is None:
            return [], None
        _check_positive(tp_size=tp_size, max_requests=max_requests, max_tokens=max_tokens,
                        max_sequence_length=max_sequence_length)
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens ({num_speculative_tokens}) must be >= 0")
        distribution = _distribution(sizing_distribution)
        rows = num_speculative_tokens + 1
        if cuda_graph_max_tokens is None or not 0 < cuda_graph_max_tokens <= max_tokens:
            cuda_graph_max_tokens = max_tokens
        if cuda_graph_max_tokens < max_requests * rows:
            raise ValueError(
                f"cuda_graph_max_tokens ({cuda_graph_max_tokens}; at most max_tokens, {max_tokens}) must be >= "
                f"max_requests ({max_requests}) * (num_speculative_tokens ({num_speculative_tokens}) + 1) = "
                f"{max_requests * rows}: a decode graph of max_requests requests must fit")
        if num_cuda_graphs != -1:
            num_cuda_graphs = min(max(num_cuda_graphs, 1), cuda_graph_max_tokens)
        count_tokens = CUDAGraphBatchDimensionBuilder._calculate_cuda_graph_token_counts
        prefill_counts = count_tokens(tp_size, num_cuda_graphs, cuda_graph_max_tokens, distribution)
        decode_top = min(cuda_graph_max_tokens, max_requests * rows)
        decode_counts = count_tokens(tp_size, num_cuda_graphs, decode_top, distribution)
        if num_cuda_graphs == -1:
            smallest = math.lcm(rows, tp_size)
            floors = [n for n in (smallest, 2 * smallest) if n <= decode_top]
            decode_counts = sorted(set(decode_counts) | set(floors), reverse=True)

        dims: list[InferenceBatchDimensions] = []

        def add_if_valid(token_count: int, prefill_req_count: int, decode_req_count: int) -> None:
            dim = InferenceBatchDimensions(token_count, prefill_req_count, decode_req_count)
            if dim.is_valid(max_requests, max_sequence_length, num_speculative_tokens):
                dims.append(dim)

        mixed = bool(use_cuda_graphs_for_non_decode_steps and cuda_graph_mixed_prefill_request_count
                     and cuda_graph_mixed_prefill_request_count > 0)
        if mixed:
            if distribution is CudaGraphSizingDistribution.LINEAR:
                prefill_options = [min(cuda_graph_mixed_prefill_request_count, max_requests)]
                fewest_prefills = cuda_graph_mixed_prefill_request_count
            else:
                prefill_options = [1 << i for i in range((max_requests - 1).bit_length())] + [max_requests]
                fewest_prefills = 1
            for size in prefill_counts:
                if size % tp_size:
                    raise ValueError(
                        f"cuda_graph_max_tokens ({cuda_graph_max_tokens}) must be a multiple of tp_size ({tp_size}) "
                        f"for mixed prefill graphs with {distribution.value} sizing and num_cuda_graphs=-1")
                if size < 2:  # a one-token prefill graph cannot be captured (its logits gather needs two rows)
                    continue
                for prefill in prefill_options:
                    decode = max(0, min((size - prefill) // rows, max_requests - prefill))
                    add_if_valid(size, prefill, decode)
                # Prefill-only: enough requests that none is longer than max_sequence_length - 1.
                fewest = max(fewest_prefills, math.ceil(size / max(1, max_sequence_length - 1)))
                if fewest < max_requests:
                    add_if_valid(size, max(fewest, min(max_requests, size)), 0)
        for size in decode_counts:
            decode = min(size // rows, max_requests)
            add_if_valid(decode * rows // tp_size * tp_size, 0, decode)

        dims = list(dict.fromkeys(dims))
        dims.sort(key=lambda d: (d.token_count - d.decode_req_count * rows, d.decode_req_count), reverse=True)
        token_counts = sorted({d.token_count for d in dims}, reverse=True) or None
        return dims, token_counts

    @staticmethod
    def match_graph_config(
        real_batch_dim: InferenceBatchDimensions,
        cuda_graph_batch_dimensions_list: list[InferenceBatchDimensions],
        strict: bool = False,
        ep_group: Any = None,
        ep_zmq_communicator: Any = None,
        match_ep_token_counts: bool = True,
    ) -> InferenceBatchDimensions | None:
        """The smallest graph (tuple order) of the list that can run ``real_batch_dim``, or None (run eagerly).

        ``strict``: see :meth:`InferenceBatchDimensions.is_applicable_for_batch_dim`. With
        ``match_ep_token_counts`` (the default) the step is first adjusted over the expert-parallel ranks
        (:meth:`InferenceBatchDimensions.adjust_batch_dims_for_expert_parallelism`, a collective on every rank of
        ``ep_group`` when the list is not empty), so that all of them pick a graph of the same token count;
        turn it off when the MoE dispatcher copes with different token counts per rank.
        """
        if not cuda_graph_batch_dimensions_list:
            return None
        dims: InferenceBatchDimensions | None = real_batch_dim
        if match_ep_token_counts:
            dims = InferenceBatchDimensions.adjust_batch_dims_for_expert_parallelism(
                real_batch_dim, ep_group=ep_group, ep_zmq_communicator=ep_zmq_communicator)
            if dims is None:
                return None
        fitting = [g for g in cuda_graph_batch_dimensions_list if g.is_applicable_for_batch_dim(dims, strict=strict)]
        return min(fitting, default=None)
