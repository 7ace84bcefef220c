"""The reshard planner on hand-made rosters (no process group): plans replayed in memory.

A full tensor is cut into source and destination shards by a layout (TP world and stride, packed
``partition_sizes`` blocks, EP over dim 0, DP replicas); every rank's plan is built from the same rosters,
each receive is paired with the send of the same ``task_id`` and copied; every destination shard must then
equal its cut of the full tensor exactly. Also: bad layouts raise ``ValueError`` naming the tensor and shapes.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.resharding import ParameterMetadata, build_plan_from_rosters, index_metadata_rosters
from megatron_core.resharding.utils import assign_resolved_name_inplace


def _cut(full: torch.Tensor, dim: int, world: int, stride: int, index: int, sizes: list[int] | None = None):
    """Shard ``index`` of ``full`` along ``dim``: segments ``index, index + world, ...`` (or packed blocks)."""
    if sizes is not None:
        blocks = full.split([s * world for s in sizes], dim=dim)
        return torch.cat([b.chunk(world, dim=dim)[index] for b in blocks], dim=dim)
    segs = full.chunk(world * stride, dim=dim)
    return torch.cat([segs[index + k * world] for k in range(stride)], dim=dim)


def _meta(name, shard, rank, tp_ranks, dim=0, stride=1, sizes=None, ep_ranks=None, dp_ranks=None):
    meta = ParameterMetadata(name=name, shape=tuple(shard.shape), dtype=shard.dtype,
                             element_size=shard.element_size(), is_tp=len(tp_ranks) > 0, partition_dim=dim,
                             partition_stride=stride, partition_sizes=sizes, is_ep=ep_ranks is not None,
                             num_experts=None, owner_rank=rank, tensor_parallel_group_ranks=tp_ranks or None,
                             expert_parallel_group_ranks=ep_ranks, data_parallel_group_ranks=dp_ranks or [rank])
    assign_resolved_name_inplace(meta)
    return meta


def _replay(world: int, src: dict[int, tuple], dst: dict[int, tuple]) -> dict[int, torch.Tensor]:
    """``src`` / ``dst``: rank -> (metadata, tensor). Returns every destination tensor after the plans ran."""
    pairs = [([src[r][0]] if r in src else [], [dst[r][0]] if r in dst else []) for r in range(world)]
    rosters = index_metadata_rosters(pairs)
    plans = {r: build_plan_from_rosters(*rosters, r) for r in range(world)}
    sends = {op.task_id: (r, op) for r, p in plans.items() for op in p.send_ops}
    recvs = [(r, op) for r, p in plans.items() for op in p.recv_ops]
    assert sorted(sends) == sorted(op.task_id for _, op in recvs)
    out = {r: torch.full_like(t, float("nan")) for r, (_, t) in dst.items()}
    for rank, op in recvs:
        src_rank, send = sends[op.task_id]
        assert (send.peer_rank, op.peer_rank) == (rank, src_rank)
        assert (send.my_slice, send.peer_slice) == (op.peer_slice, op.my_slice)
        out[rank][op.my_slice] = src[src_rank][1][send.my_slice]
    return out


@pytest.mark.parametrize("src_tp,src_stride,dst_tp,dst_stride", [
    (2, 1, 3, 1), (3, 1, 2, 1), (2, 2, 3, 2), (1, 2, 4, 2), (4, 2, 1, 2), (2, 2, 6, 2),
])
def test_tp_tiling_with_strides(src_tp: int, src_stride: int, dst_tp: int, dst_stride: int):
    full = torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5)
    world = max(src_tp, dst_tp)
    src_ranks, dst_ranks = list(range(src_tp)), list(range(dst_tp))
    src = {r: (_meta("w", s := _cut(full, 0, src_tp, src_stride, r), r, src_ranks, stride=src_stride), s)
           for r in src_ranks}
    dst = {r: (_meta("w", s := _cut(full, 0, dst_tp, dst_stride, r), r, dst_ranks, stride=dst_stride), s)
           for r in dst_ranks}
    out = _replay(world, src, dst)
    for r in dst_ranks:
        assert torch.equal(out[r], _cut(full, 0, dst_tp, dst_stride, r))


def test_packed_blocks_and_row_dim_and_dp_replicas():
    # partition_sizes: three packed components (full widths 4, 8, 12) along dim 1, Mamba in_proj style.
    full = torch.randn(3, 24)
    src_sizes = [2, 4, 6]  # per-rank block widths at TP=2 (TP=1 holds 4, 8, 12)
    src = {}
    for r in range(4):  # TP=2 x DP=2: ranks (0, 1) and (2, 3) hold identical shards
        tp_ranks = [0, 1] if r < 2 else [2, 3]
        shard = _cut(full, 1, 2, 1, r % 2, sizes=src_sizes)
        src[r] = (_meta("in_proj.weight", shard, r, tp_ranks, dim=1, sizes=src_sizes, dp_ranks=[r % 2, r % 2 + 2]),
                  shard)
    dst = {r: (_meta("in_proj.weight", full, r, [r], dim=1, sizes=[4, 8, 12]), full) for r in range(4)}
    out = _replay(4, src, dst)
    for r in range(4):
        assert torch.equal(out[r], full)


def test_stacked_experts_ep2_tp2_to_ep1_tp1():
    full = torch.randn(4, 6, 8)  # [experts, out, in]; fc1-like: TP on dim 1
    src = {}
    for r in range(4):  # ranks: ep = r // 2, tp = r % 2
        ep_ranks, tp_ranks = [r % 2, r % 2 + 2], [r - r % 2, r - r % 2 + 1]
        shard = full.chunk(2, dim=0)[r // 2].chunk(2, dim=1)[r % 2]
        src[r] = (_meta("experts.weight", shard, r, tp_ranks, dim=1, ep_ranks=ep_ranks), shard)
    dst = {r: (_meta("experts.weight", full, r, [r], dim=1, ep_ranks=[r]), full) for r in range(4)}
    out = _replay(4, src, dst)
    for r in range(4):
        assert torch.equal(out[r], full)


def test_mismatched_shapes_raise_value_error_naming_parameter():
    a, b = torch.zeros(8, 4), torch.zeros(8, 5)
    src = {0: (_meta("decoder.layers.0.mlp.linear_fc1.weight", a, 0, [0]), a)}
    dst = {0: (_meta("decoder.layers.0.mlp.linear_fc1.weight", b, 0, [0]), b)}
    with pytest.raises(ValueError, match=r"linear_fc1\.weight.*\(8, 4\).*\(8, 5\)"):
        _replay(1, src, dst)
    c = torch.zeros(3, 4)  # TP=2 x 3 rows cannot become 8 rows
    src = {r: (_meta("w", c, r, [0, 1]), c) for r in range(2)}
    dst = {0: (_meta("w", a, 0, [0]), a)}
    with pytest.raises(ValueError, match=r"'w'.*\(3, 4\).*\(8, 4\).*3 x 2 source"):
        _replay(2, src, dst)


def test_missing_source_parameter_raises():
    a = torch.zeros(2)
    with pytest.raises(ValueError, match="'only_in_dst'.*not in the source model"):
        _replay(1, {0: (_meta("other", a, 0, []), a)}, {0: (_meta("only_in_dst", a, 0, []), a)})
    with pytest.raises(RuntimeError):  # the error is also a RuntimeError, as Megatron-Core raises
        _replay(1, {0: (_meta("other", a, 0, []), a)}, {0: (_meta("only_in_dst", a, 0, []), a)})
