"""Data side of hybrid context parallelism: regroup packed samples over the DP x CP ranks.

:class:`HybridCPDataLoaderWrapper` wraps a data iterator whose items are lists of packed samples
(dicts of token-major tensors plus ``cu_seqlens``). Each call gathers the sub-sample lengths of the
DP group, schedules them with :class:`BalancedCPScheduler`, and moves every sub-sample to the DP x CP
ranks that run it (one ``all_to_all_single`` per key).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_core import device
from megatron_core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler, misaligned_subsample
from megatron_core.process_groups_config import ProcessGroupCollection, resolve_process_group

__all__ = ["BalancedCPScheduler", "HybridCPDataLoaderWrapper", "check_aligned_placement"]

# Keys of a packed sample that describe the packing rather than hold per-token data.
_PACKING_KEYS = ("cu_seqlens", "batch_idx", "max_seqlen")


def check_aligned_placement(sample_id_groups: list[list[list[int]]]) -> None:
    """Raise ``ValueError`` unless every sub-sample of every group runs on one aligned block of ranks
    (:func:`~megatron_core.pipeline_parallel.hybrid_cp_schedule.misaligned_subsample` says which ones do)."""
    for g, group in enumerate(sample_id_groups):
        bad = misaligned_subsample(group)
        if bad is not None:
            sample_id, ranks = bad
            raise ValueError(f"hybrid context parallelism: sub-sample {sample_id} of group {g} is placed on ranks "
                             f"{ranks}, not one aligned block of {len(ranks)} ranks (a power of two starting at a "
                             "multiple of it); its ranks would build different CP groups and hang")


class HybridCPDataLoaderWrapper:
    """Iterator over ``(samples of this rank by global id, sample_id_groups)`` for hybrid context parallelism.

    Every DP rank pulls one batch (a list of packed samples) per step; the sub-samples of the whole
    DP group get global ids (DP rank order, then order within the batch) and are scheduled on the
    DP x CP ranks with ``config.max_seqlen_per_dp_cp_rank``. ``sample_id_groups[g][r]`` lists the ids
    rank ``r`` of the DP x CP group runs in group ``g``; a sub-sample's CP size there is the number of
    ranks listing it. Ranks without a data iterator (``data_iterator=None``) get ``(None, None)``.
    """

    def __init__(self, data_iterator: Any, config: Any, pg_collection: ProcessGroupCollection | None = None) -> None:
        self.data_iterator = data_iterator
        self.config = config
        # pg_collection's groups, else parallel_state's (the package resolver)
        self.dp_cp_group = resolve_process_group("dp_cp", pg_collection)
        self.dp_group = resolve_process_group("dp", pg_collection)
        self.tp_group = resolve_process_group("tp", pg_collection)
        missing = [name for name in ("dp_cp_group", "dp_group", "tp_group") if getattr(self, name) is None]
        if missing:
            raise ValueError(f"HybridCPDataLoaderWrapper: {missing} must not be None (hybrid context parallelism "
                             "needs the DP x CP, DP and TP groups)")
        max_seqlen = getattr(config, "max_seqlen_per_dp_cp_rank", None)
        if max_seqlen is None:
            raise ValueError("HybridCPDataLoaderWrapper: config.max_seqlen_per_dp_cp_rank (None) must be set to "
                             "the longest sequence one DP x CP rank can hold")
        self.cp_balancing_scheduler = BalancedCPScheduler(max_seq_len_per_rank=max_seqlen,
                                                          dp_cp_group=self.dp_cp_group)
        self.total_hdp_gpus = self.dp_cp_group.size()
        # Global rank -> index in the DP x CP group; the DP group's members as such indices.
        hdp_ranks = dist.get_process_group_ranks(self.dp_cp_group)
        self._hdp_index = {rank: i for i, rank in enumerate(hdp_ranks)}
        self._dp_hdp_ranks = [self._hdp_index[r] for r in dist.get_process_group_ranks(self.dp_group)]

    def __iter__(self) -> HybridCPDataLoaderWrapper:
        """This wrapper is its own iterator."""
        return self

    def get_global_seqlens(self, subsample_seqlens: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """All-gather the sub-sample lengths of the DP group.

        Returns the lengths in DP rank order and each DP rank's offset (its first global id).
        """
        dev = device.get_current_device()
        local = subsample_seqlens.to(device=dev, dtype=torch.int32)
        count = torch.tensor([local.numel()], dtype=torch.int32, device=dev)
        counts = [torch.zeros_like(count) for _ in range(self.dp_group.size())]
        dist.all_gather(counts, count, group=self.dp_group)
        counts_cpu = torch.cat(counts).cpu()
        longest = int(counts_cpu.max())
        padded = torch.zeros(longest, dtype=torch.int32, device=dev)
        padded[:local.numel()] = local
        gathered = [torch.empty_like(padded) for _ in range(self.dp_group.size())]
        dist.all_gather(gathered, padded, group=self.dp_group)
        seqlens: list[int] = []
        for dp_rank, lengths in enumerate(gathered):
            seqlens.extend(lengths[:int(counts_cpu[dp_rank])].cpu().tolist())
        ends = torch.cumsum(counts_cpu, dim=0, dtype=torch.int32)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int32), ends[:-1]])
        return seqlens, offsets

    def get_global_id_seqlens(self, num_local_subsamples: int, offsets: torch.Tensor, seqlens_gathered: list[int],
                              ) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """``(global id, length)`` of every gathered sub-sample, and the global ids held by this rank."""
        start = int(offsets[self.dp_group.rank()])
        global_id_seqlens = list(enumerate(seqlens_gathered))
        return global_id_seqlens, torch.arange(start, start + num_local_subsamples, dtype=torch.int32)

    def _gid_to_src_rank(self, gid: int, offsets: torch.Tensor) -> int:
        """DP x CP index of the rank of this DP group that loaded sub-sample ``gid``."""
        dp_rank = int(torch.bucketize(torch.tensor(int(gid)), offsets[1:] - 1))
        return self._dp_hdp_ranks[dp_rank]

    def reroute_samples_to_hdp_ranks(self, batch: list[dict], global_ids_this_rank: torch.Tensor,
                                     global_id_seqlens: list[tuple[int, int]],
                                     sample_id_groups: list[list[list[int]]], offsets: torch.Tensor,
                                     ) -> dict[int, dict[str, torch.Tensor]]:
        """Send each local sub-sample to the ranks scheduled to run it; return ``{global id: sub-sample}``.

        CP ranks of one DP replica hold the same data, so a rank only exchanges with the members of
        its own DP group (same CP index). ``batch`` is the unpacked list of local sub-samples.
        """
        n = self.total_hdp_gpus
        local_ids = [int(g) for g in global_ids_this_rank]
        local_index = {gid: i for i, gid in enumerate(local_ids)}
        length = dict(global_id_seqlens)
        per_rank = [sorted(gid for group in sample_id_groups for gid in group[r]) for r in range(n)]
        peers = set(self._dp_hdp_ranks)
        send_ids = [[gid for gid in per_rank[r] if gid in local_index] if r in peers else [] for r in range(n)]
        me = self._hdp_index[dist.get_rank()]
        recv_ids: list[list[int]] = [[] for _ in range(n)]
        for gid in per_rank[me]:
            recv_ids[self._gid_to_src_rank(gid, offsets)].append(gid)
        send_splits = [sum(length[g] for g in ids) for ids in send_ids]
        recv_splits = [sum(length[g] for g in ids) for ids in recv_ids]
        recv_order = [gid for ids in recv_ids for gid in ids]
        received: dict[int, dict[str, torch.Tensor]] = {gid: {} for gid in recv_order}
        dev = device.get_current_device()
        keys = list(batch[0].keys()) if batch else []
        for key in keys:
            like = batch[0][key]
            parts = [batch[local_index[gid]][key].to(dev) for ids in send_ids for gid in ids]
            send = torch.cat(parts) if parts else torch.empty((0, *like.shape[1:]), dtype=like.dtype, device=dev)
            recv = torch.empty((sum(recv_splits), *like.shape[1:]), dtype=send.dtype, device=dev)
            dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=recv_splits,
                                   input_split_sizes=send_splits, group=self.dp_cp_group)
            cursor = 0
            for gid in recv_order:
                received[gid][key] = recv[cursor:cursor + length[gid]]
                cursor += length[gid]
        return received

    def unpack_batch(self, batch: list[dict]) -> list[dict[str, torch.Tensor]]:
        """Split packed samples into their non-empty sub-samples (``cu_seqlens``, ``batch_idx``, ``max_seqlen`` dropped)."""
        out = []
        for sample in batch:
            bounds = [int(b) for b in sample["cu_seqlens"]]
            for start, end in zip(bounds[:-1], bounds[1:], strict=False):
                if end == start:
                    continue
                out.append({key: value[start:end] for key, value in sample.items() if key not in _PACKING_KEYS})
        return out

    def __next__(self) -> tuple[dict[int, dict[str, torch.Tensor]] | None, list[list[list[int]]] | None]:
        """Pull a batch, schedule its sub-samples over the DP x CP group and return this rank's share."""
        if self.data_iterator is None:
            return None, None
        batch = next(self.data_iterator)
        lengths = []
        for i, sample in enumerate(batch):
            bounds = [int(b) for b in sample["cu_seqlens"]]
            steps = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=False)]
            if any(step < 0 for step in steps):
                raise ValueError(f"HybridCPDataLoaderWrapper: cu_seqlens {bounds} of sample {i} must not decrease")
            lengths.extend(step for step in steps if step > 0)
        local = torch.tensor(lengths, dtype=torch.int32)
        seqlens, offsets = self.get_global_seqlens(local)
        global_id_seqlens, global_ids_this_rank = self.get_global_id_seqlens(len(lengths), offsets, seqlens)
        _, sample_id_groups = self.cp_balancing_scheduler.get_groups_and_subsamples(global_id_seqlens, self.config)
        check_aligned_placement(sample_id_groups)
        samples = self.reroute_samples_to_hdp_ranks(self.unpack_batch(batch), global_ids_this_rank,
                                                    global_id_seqlens, sample_id_groups, offsets)
        return samples, sample_id_groups
