"""Workload-balanced placement of variable-length samples on the DP x CP ranks (hybrid context parallelism).

:class:`BalancedCPScheduler` gives every sub-sample a power-of-two CP size (its length over
``max_seq_len_per_rank``) and packs the sub-samples into successive *groups*: within a group each
DP x CP rank runs its samples back to back, and ranks sharing a sample form one CP group for it.
Groups end where the ranks' estimated workloads (``length**2 / cp_size``) are balanced.

:func:`hybrid_context_parallel_forward_backward` is the matching schedule (the one
``forward_backward_no_pipelining`` runs under ``config.hybrid_context_parallel``): each rank runs its
sub-samples one micro-batch at a time, telling the model each one's CP size (``local_cp_size``), with a
barrier of the DP x CP group between groups. Only tensor-parallel rank 0 reads data; it broadcasts the
counts and CP sizes to the other TP ranks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from math import ceil, log2
from typing import Any

import torch
import torch.distributed as dist

from megatron_core import device, parallel_state
from megatron_core.pipeline_parallel import microbatch_step
from megatron_core.pipeline_parallel.microbatch_step import add_token_count
from megatron_core.rerun_state_machine import RerunDataIterator

__all__ = ["BalancedCPScheduler", "hybrid_context_parallel_forward_backward", "misaligned_subsample"]

# The module whose forward_step / backward_step run each sub-sample, looked up at call time: microbatch_step's
# until pipeline_parallel.schedules is imported, then schedules' (it installs itself through
# _set_step_functions; it imports this module, so this module cannot import it). As in Megatron-Core, patching
# schedules.forward_step (its unit tests do) changes what this schedule runs.
_step_functions: Any = microbatch_step


def _set_step_functions(module: Any) -> None:
    global _step_functions
    _step_functions = module

SampleSeqlen = tuple[int, int]  # (sample id, sequence length)


def misaligned_subsample(group: list[list[int]]) -> tuple[int, list[int]] | None:
    """The first ``(sample id, ranks)`` of a group (sample ids per DP x CP rank) not placed on one aligned block.

    A sub-sample placed on ``k`` ranks takes the CP group of size ``k`` that holds them, and the hybrid CP groups
    of size ``k`` are the blocks ``[j k, (j + 1) k)``: a power of two ``k`` of consecutive ranks starting at a
    multiple of ``k``. Ranks outside one such block would each pick a different group and wait on each other.
    ``None`` when every sub-sample is aligned.
    """
    ranks_of: dict[int, list[int]] = {}
    for rank, sample_ids in enumerate(group):
        for sample_id in sample_ids:
            ranks_of.setdefault(int(sample_id), []).append(rank)
    for sample_id, ranks in ranks_of.items():
        size, first = len(ranks), ranks[0]
        if size & (size - 1) or first % size or ranks != list(range(first, first + size)):
            return sample_id, ranks
    return None


class BalancedCPScheduler:
    """Form balanced groups of sub-samples over ``dp_cp_group.size()`` ranks (Megatron-Core's scheduler)."""

    def __init__(self, max_seq_len_per_rank: int, dp_cp_group: dist.ProcessGroup | Any) -> None:
        if not isinstance(max_seq_len_per_rank, int) or isinstance(max_seq_len_per_rank, bool) \
                or max_seq_len_per_rank < 1:
            raise ValueError(f"BalancedCPScheduler: max_seq_len_per_rank ({max_seq_len_per_rank!r}) must be a "
                             "positive int (set max_seqlen_per_dp_cp_rank in the config)")
        self.max_seq_len_per_rank = max_seq_len_per_rank
        self.num_subsamples = 0
        self.num_subsamples_processed = 0
        self.free_resources: list = []
        self.total_hdp_gpus = dp_cp_group.size()

    def gpus_needed(self, seq_len: int) -> int:
        """CP size of a sub-sample: ``seq_len / max_seq_len_per_rank`` rounded up to a power of two (at least 1)."""
        if seq_len < 1:
            raise ValueError(f"BalancedCPScheduler: sequence length {seq_len} must be positive")
        return max(1, 2 ** ceil(log2(seq_len / self.max_seq_len_per_rank)))

    def get_total_workload(self, seq_length: int, cp_size: int | None = None) -> float:
        """Relative cost of a sub-sample on each of its ranks: ``seq_length**2 / cp_size`` (an estimate, not FLOPs)."""
        if cp_size is None:
            cp_size = self.gpus_needed(seq_length)
        return seq_length * seq_length / cp_size

    def make_buckets_equal(self, sample_seqlens: list[SampleSeqlen], compute_estimator: Any) -> list[deque]:
        """Split ``sample_seqlens`` (in order) into as many buckets as distinct CP sizes, of similar total work.

        A bucket closes when adding the next sample would pass 110% of the per-bucket target, or
        when the samples left are only just enough to give one to each remaining bucket.
        """
        num_buckets = len({self.gpus_needed(length) for _, length in sample_seqlens})
        total = sum(compute_estimator(length, self.gpus_needed(length)) for _, length in sample_seqlens)
        target = total / num_buckets
        buckets: list[deque] = []
        current: list[SampleSeqlen] = []
        current_work = 0.0
        buckets_left = num_buckets
        for index, (sample_id, length) in enumerate(sample_seqlens):
            work = compute_estimator(length)
            too_heavy = current_work + work > 1.1 * target
            save_for_rest = len(sample_seqlens) - index <= buckets_left - len(buckets)
            if current and (too_heavy or save_for_rest):
                buckets.append(deque(current))
                current, current_work = [], 0.0
                buckets_left -= 1
            current.append((sample_id, length))
            current_work += work
        if current:
            buckets.append(deque(current))
        return buckets

    def next_hdp_group(self, sample_seqlens: list[SampleSeqlen], compute_estimator: Any, total_gpus: int,
                       delta: float = 0.05, strategy: str = "dp", eps_bucket: float = 0.10,
                       ) -> tuple[list[list[int]], list[SampleSeqlen], list[float], list[list[int]]]:
        """Place samples (taken in bucket order) on ``total_gpus`` ranks until the group is balanced.

        Each sample goes to a fresh set of its CP size of free ranks if there are enough, else to the
        least-loaded existing rank set of that size. Once a sample with a smaller CP size than the
        first one has been placed, the group closes as soon as the loads are within ``delta``. Then
        trailing samples are returned while that improves the balance, and ranks left empty are
        filled by doubling the CP size of the smallest rank set. ``eps_bucket`` is unused.

        Returns ``(seqlens per rank, leftover samples, estimated load per rank, sample ids per rank)``.
        """
        if strategy not in ("dp", "pp"):
            raise ValueError(f"next_hdp_group: strategy {strategy!r} must be 'dp' or 'pp'")
        if not sample_seqlens:
            return ([[] for _ in range(total_gpus)], [], [0.0] * total_gpus, [[] for _ in range(total_gpus)])
        state = _Placement(total_gpus)
        buckets = self.make_buckets_equal(sample_seqlens, compute_estimator)
        first_needed: int | None = None
        check_balance = False
        cursor = 0
        while buckets:
            picked = self._pick(buckets, state, cursor if strategy == "pp" else 0)
            if picked is None:
                break
            bucket_index = picked
            sample_id, length = buckets[bucket_index][0]
            if strategy == "pp":
                cursor = (bucket_index + 1) % len(buckets)
            needed = self.gpus_needed(length)
            first_needed = needed if first_needed is None else first_needed
            members = state.choose(needed)
            state.assign(members, sample_id, length, compute_estimator(length))
            buckets[bucket_index].popleft()
            while buckets and not buckets[0]:
                buckets.pop(0)
                cursor %= max(1, len(buckets))
            if needed < first_needed:
                check_balance = True
            if check_balance and buckets and state.balanced(delta):
                break
        leftovers = [item for bucket in buckets for item in bucket]
        state.trim(delta, compute_estimator, leftovers)
        before = sum(len(seqs) for seqs in state.seqlens)
        while any(not seqs for seqs in state.seqlens):
            state.widen_smallest(self.get_total_workload)
        if sum(len(seqs) for seqs in state.seqlens) < before:
            raise RuntimeError("next_hdp_group: filling empty ranks dropped samples")
        if misaligned_subsample(state.sample_ids) is not None:
            state.realign()  # rare (Megatron-Core's placement would hang there); otherwise its placement as is
        return state.seqlens, leftovers, state.loads, state.sample_ids

    def _pick(self, buckets: list[deque], state: _Placement, start: int) -> int | None:
        """Index of the first non-empty bucket (scanning from ``start``) whose head sample fits somewhere."""
        for offset in range(len(buckets)):
            index = (start + offset) % len(buckets)
            if buckets[index] and state.fits(self.gpus_needed(buckets[index][0][1])):
                return index
        return None

    def get_groups_and_subsamples(self, sample_id_seqlens: list[SampleSeqlen], config: Any = None,
                                  ) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
        """Schedule every ``(sample id, length)`` pair, longest first, into successive balanced groups.

        Returns ``(groups, sample_id_groups)``: for each group, per DP x CP rank, the lengths and the
        ids of the sub-samples that rank runs. A sample's CP size in a group is the number of ranks
        listing it. A sample longer than ``max_seq_len_per_rank`` times the DP x CP size raises ``ValueError``.
        """
        pending = sorted(sample_id_seqlens, key=lambda item: item[1], reverse=True)
        too_long = [(sid, length) for sid, length in pending if self.gpus_needed(length) > self.total_hdp_gpus]
        if too_long:
            raise ValueError(
                f"BalancedCPScheduler: sub-samples {too_long} (id, length) need more than the "
                f"{self.total_hdp_gpus} DP x CP ranks at max_seq_len_per_rank={self.max_seq_len_per_rank}")
        groups: list[list[list[int]]] = []
        sample_id_groups: list[list[list[int]]] = []
        while pending:
            seqlens, pending, _, sample_ids = self.next_hdp_group(pending, self.get_total_workload,
                                                                  self.total_hdp_gpus)
            groups.append(seqlens)
            sample_id_groups.append(sample_ids)
        return groups, sample_id_groups


class _Placement:
    """The ranks of one group being filled: per-rank sample lists and loads, and the rank sets (CP groups)."""

    def __init__(self, total_gpus: int) -> None:
        self.total = total_gpus
        self.seqlens: list[list[int]] = [[] for _ in range(total_gpus)]
        self.sample_ids: list[list[int]] = [[] for _ in range(total_gpus)]
        self.loads = [0.0] * total_gpus
        self.owner: list[int | None] = [None] * total_gpus
        self.members: dict[int, list[int]] = {}   # rank-set id -> ranks (ids in creation order)
        self.size: dict[int, int] = {}

    def free_ranks(self) -> list[int]:
        return [r for r, gid in enumerate(self.owner) if gid is None]

    def fits(self, needed: int) -> bool:
        return needed in self.size.values() or len(self.free_ranks()) >= needed

    def choose(self, needed: int) -> list[int]:
        """Ranks for a sample of CP size ``needed``: fresh free ranks if they are less loaded, else the best set."""
        best_gid, best_load = None, float("inf")
        for gid, size in self.size.items():
            load = max(self.loads[r] for r in self.members[gid])
            if size == needed and load < best_load:
                best_gid, best_load = gid, load
        free = sorted(self.free_ranks(), key=lambda r: self.loads[r])
        if len(free) >= needed and self.loads[free[needed - 1]] < best_load:
            gid = len(self.members)
            self.members[gid], self.size[gid] = free[:needed], needed
            for r in free[:needed]:
                self.owner[r] = gid
            return free[:needed]
        return self.members[best_gid]

    def assign(self, ranks: list[int], sample_id: int, length: int, cost: float) -> None:
        for r in ranks:
            self.seqlens[r].append(length)
            self.sample_ids[r].append(sample_id)
            self.loads[r] += cost

    def balanced(self, delta: float) -> bool:
        return max(self.loads) - min(self.loads) <= delta * max(self.loads)

    def trim(self, delta: float, compute_estimator: Any, leftovers: list[SampleSeqlen]) -> None:
        """Hand back the most-loaded rank set's last sample while that narrows the load spread."""
        while True:
            high, low = max(self.loads), min(self.loads)
            if high - low <= delta * high or low == 0:
                return
            top = self.loads.index(high)
            if len(self.seqlens[top]) <= 1:
                return
            ranks = self.members[self.owner[top]]
            length = self.seqlens[top][-1]
            cost = compute_estimator(length)
            projected = [load - cost if r in ranks else load for r, load in enumerate(self.loads)]
            if max(projected) - min(projected) >= high - low:
                return
            sample_id = self.sample_ids[top][-1]
            for r in ranks:
                self.seqlens[r].pop()
                self.sample_ids[r].pop()
                self.loads[r] -= cost
            leftovers.append((sample_id, length))

    def realign(self) -> None:
        """Lay the rank sets out again, largest first on consecutive ranks, so that each set of size ``k`` starts
        at a multiple of ``k`` (sizes are powers of two); every set keeps its samples and per-rank loads."""
        first_rank = {gid: min(ranks) for gid, ranks in self.members.items()}
        order = sorted(self.members, key=lambda gid: (-self.size[gid], first_rank[gid]))
        seqlens: list[list[int]] = [[] for _ in range(self.total)]
        sample_ids: list[list[int]] = [[] for _ in range(self.total)]
        loads = [0.0] * self.total
        owner: list[int | None] = [None] * self.total
        start = 0
        for gid in order:
            old_ranks, size = self.members[gid], self.size[gid]
            new_ranks = list(range(start, start + size))
            for old, new in zip(old_ranks, new_ranks):
                seqlens[new], sample_ids[new], loads[new] = self.seqlens[old], self.sample_ids[old], self.loads[old]
                owner[new] = gid
            self.members[gid] = new_ranks
            start += size
        if start != self.total:
            raise RuntimeError(f"next_hdp_group: the rank sets cover {start} of {self.total} ranks")
        self.seqlens, self.sample_ids, self.loads, self.owner = seqlens, sample_ids, loads, owner

    def widen_smallest(self, workload: Any) -> None:
        """Double the first smallest rank set (capped at all ranks) onto the next ranks, shifting later sets up."""
        smallest = min(self.size.values())
        grown = min(2 * smallest, self.total)
        extra = grown - smallest
        gid = next(g for g, size in self.size.items() if size == smallest)
        start, end = self.members[gid][0], self.members[gid][-1]
        first_empty = next(r for r, seqs in enumerate(self.seqlens) if not seqs)
        shift = range(end + 1, first_empty)
        seqlens: list[list[int]] = [[] for _ in range(self.total)]
        sample_ids: list[list[int]] = [[] for _ in range(self.total)]
        loads = [0.0] * self.total
        for r in range(start):
            seqlens[r], sample_ids[r], loads[r] = self.seqlens[r], self.sample_ids[r], self.loads[r]
        for r in range(start, end + extra + 1):
            seqlens[r], sample_ids[r] = list(self.seqlens[end]), list(self.sample_ids[end])
            loads[r] = workload(self.seqlens[end][0], grown)
        for i, r in enumerate(shift):
            seqlens[end + extra + 1 + i], sample_ids[end + extra + 1 + i] = self.seqlens[r], self.sample_ids[r]
            loads[end + extra + 1 + i] = self.loads[r]
        self.seqlens, self.sample_ids, self.loads = seqlens, sample_ids, loads
        self.size[gid] = grown
        self.members[gid] = list(range(start, end + extra + 1))
        for later in self.size:
            if later > gid:
                self.members[later] = [r + extra for r in self.members[later]]


def hybrid_context_parallel_forward_backward(
    forward_step_func: Callable,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    input_tensor: Any,
    output_tensor_grad: Any,
    forward_data_store: list,
    config: Any,
    collect_non_loss_data: bool,
    first_val_step: bool | None,
    forward_only: bool,
    no_sync_func: Callable[[], Any],
    total_num_tokens: Any,
    check_first_val_step: Callable[[bool | None, bool, bool], bool],
    model_type: Any,
) -> tuple[list, Any]:
    """Run this rank's scheduled sub-samples, one forward (and backward) each; Megatron-Core's hybrid CP schedule.

    ``data_iterator`` (read on tensor-parallel rank 0 only) yields ``(samples, sample_id_groups)`` once per
    step, as ``HybridCPDataLoaderWrapper`` does: ``samples`` maps a sub-sample id to its dict and
    ``sample_id_groups[g][r]`` lists the ids DP x CP rank ``r`` runs in group ``g``. A sub-sample's CP size
    is the number of ranks listing it in that group; its dict is passed to ``forward_step_func`` (through a
    one-item :class:`RerunDataIterator`) with ``local_cp_size`` (an int32 tensor) added, and the size is the
    forward step's ``cp_group_size``. The other TP ranks get the counts and sizes by broadcast from TP rank 0
    and a ``None`` iterator. Gradient reduction is held back (``no_sync_func``) until the last sub-sample;
    the DP x CP group meets at a barrier after each group but the last, so no rank starts a group (and its
    new CP groups) while a partner still runs the previous one. ``model_type`` is unused.

    Returns ``(forward_data_store, total_num_tokens)``, ``total_num_tokens`` increased by every sub-sample's
    token count (in place when it is a tensor).
    """
    hdp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    is_reader = parallel_state.get_tensor_model_parallel_rank() == 0
    samples = sample_id_groups = counts = None
    if is_reader:
        samples, sample_id_groups = next(data_iterator)
        counts = [len(group[hdp_rank]) for group in sample_id_groups]
    counts = _broadcast_counts(counts)
    if not counts or min(counts) < 1:
        raise ValueError(f"hybrid_context_parallel_forward_backward: DP x CP rank {hdp_rank} got sub-sample "
                         f"counts {counts} per group; every group must give it at least one sub-sample")

    def next_sub_sample(group: int, index: int) -> tuple[Any, int]:
        """The one-item iterator over this rank's ``index``-th sub-sample of ``group``, and its CP size."""
        iterator, cp_size = None, 0
        if is_reader:
            sample_id = sample_id_groups[group][hdp_rank][index]
            cp_size = sum(sample_id in ids for ids in sample_id_groups[group])
            sample = {**samples[sample_id], "local_cp_size": torch.tensor(cp_size, dtype=torch.int32)}
            iterator = RerunDataIterator(iter([sample]))
        size = torch.tensor([cp_size], dtype=torch.int32, device=device.get_current_device())
        _broadcast_from_tp_rank_0(size)
        return iterator, cp_size if is_reader else int(size.item())

    def run(group: int, index: int, microbatch: int) -> None:
        nonlocal total_num_tokens
        iterator, cp_size = next_sub_sample(group, index)
        output_tensor, num_tokens = _step_functions.forward_step(
            forward_step_func, iterator, model, num_microbatches, input_tensor, forward_data_store, config,
            cp_group_size=cp_size, collect_non_loss_data=collect_non_loss_data,
            is_first_microbatch=check_first_val_step(first_val_step, forward_only, microbatch == 0),
            current_microbatch=microbatch,
        )
        total_num_tokens = _add_tokens(total_num_tokens, num_tokens)
        if not forward_only:
            _step_functions.backward_step(input_tensor, output_tensor, output_tensor_grad, config)

    steps = [(group, index) for group, count in enumerate(counts) for index in range(count)]
    with no_sync_func():
        for microbatch, (group, index) in enumerate(steps[:-1]):
            run(group, index, microbatch)
            if index == counts[group] - 1:  # a group other than the last one is done
                torch.distributed.barrier(group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    run(*steps[-1], len(steps) - 1)  # outside no_sync: the gradients are reduced now
    return forward_data_store, total_num_tokens


def _broadcast_from_tp_rank_0(tensor: torch.Tensor) -> None:
    torch.distributed.broadcast(tensor, parallel_state.get_tensor_model_parallel_src_rank(),
                                group=parallel_state.get_tensor_model_parallel_group())


def _broadcast_counts(counts: list[int] | None) -> list[int]:
    """TP rank 0's per-group sub-sample counts on every TP rank (the length first, then the int32 counts)."""
    dev = device.get_current_device()
    length = torch.tensor([0 if counts is None else len(counts)], dtype=torch.int64, device=dev)
    _broadcast_from_tp_rank_0(length)
    n = len(counts) if counts is not None else int(length.item())
    if n == 0:
        return []
    values = (torch.tensor(counts, dtype=torch.int32, device=dev) if counts is not None
              else torch.empty(n, dtype=torch.int32, device=dev))
    _broadcast_from_tp_rank_0(values)
    return list(counts) if counts is not None else values.tolist()


def _add_tokens(total: Any, num_tokens: Any) -> Any:
    """``total + num_tokens``: in place without a host sync when ``total`` is a tensor, else a Python int."""
    if isinstance(total, torch.Tensor):
        add_token_count(total, torch.as_tensor(num_tokens))
        return total
    return total + int(num_tokens)
