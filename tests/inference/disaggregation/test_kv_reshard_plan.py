"""``plan_kv_reshard``: applied in memory to the pieces of a known global KV grid, every destination rank ends
up with exactly its own piece, every element written once, and only overlapping rectangles move."""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.disaggregation.kv_reshard import (
    KVReshardTransfer,
    KVShardLayout,
    plan_kv_reshard,
)
from megatron_core.inference.disaggregation.utils import intersect, transfers_for_dst, transfers_for_src

LAYERS, TOKENS, HEAD_DIM = 12, 3, 2


def _layouts(tp: int, pp: int, heads: int, first_rank: int = 0, ep: int = 1,
             windows: list[tuple[int, int]] | None = None) -> list[KVShardLayout]:
    """One layout per rank, ranks ordered tp fastest, then ep, then pp (as a shard's grid)."""
    out = []
    for p in range(pp):
        for e in range(ep):
            for t in range(tp):
                window = dict(layer_start=windows[p][0], num_local_layers=windows[p][1]) if windows else {}
                out.append(KVShardLayout(num_layers=LAYERS, num_heads=heads, tp_size=tp, tp_rank=t, pp_size=pp,
                                         pp_rank=p, global_rank=first_rank + len(out), ep_size=ep, ep_rank=e,
                                         **window))
    return out


def _global_kv(heads: int) -> torch.Tensor:
    """``[layers, 2, tokens, heads, head_dim]`` with a distinct value everywhere."""
    return torch.arange(LAYERS * 2 * TOKENS * heads * HEAD_DIM, dtype=torch.float32).view(
        LAYERS, 2, TOKENS, heads, HEAD_DIM)


def _piece(kv: torch.Tensor, layout: KVShardLayout) -> torch.Tensor:
    (l0, l1), (h0, h1) = layout.layer_range(), layout.head_range()
    return kv[l0:l1, :, :, h0:h1]


def _apply(plan: list[KVReshardTransfer], srcs, dsts, kv) -> tuple[dict, dict]:
    """Each destination's assembled piece and how often each of its elements was written."""
    by_rank = {s.global_rank: s for s in srcs}
    out, writes = {}, {}
    for d in dsts:
        got = torch.full_like(_piece(kv, d), -1.0)
        count = torch.zeros_like(got)
        for t in transfers_for_dst(plan, d.global_rank):
            s = by_rank[t.src_rank]
            block = _piece(kv, s)[t.src_layer_slice(s), :, :, t.src_head_slice(s)]
            got[t.dst_layer_slice(d), :, :, t.dst_head_slice(d)] = block
            count[t.dst_layer_slice(d), :, :, t.dst_head_slice(d)] += 1
        out[d.global_rank], writes[d.global_rank] = got, count
    return out, writes


def _check(srcs, dsts, heads):
    kv = _global_kv(heads)
    plan = plan_kv_reshard(srcs, dsts)
    out, writes = _apply(plan, srcs, dsts, kv)
    for d in dsts:
        assert torch.equal(out[d.global_rank], _piece(kv, d)), f"destination rank {d.global_rank}"
        assert torch.equal(writes[d.global_rank], torch.ones_like(writes[d.global_rank])), "written once each"
    # Minimal: each transfer is exactly the overlap of its pair's rectangles, at most one per pair.
    by_rank = {s.global_rank: s for s in [*srcs, *dsts]}
    pairs = [(t.src_rank, t.dst_rank) for t in plan]
    assert len(pairs) == len(set(pairs))
    for t in plan:
        s, d = by_rank[t.src_rank], by_rank[t.dst_rank]
        assert (t.global_layer_lo, t.global_layer_hi) == intersect(s.layer_range(), d.layer_range())
        assert (t.global_head_lo, t.global_head_hi) == intersect(s.head_range(), d.head_range())
    return plan


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 1), (1, 2), (4, 2), (2, 4), (4, 4)])
@pytest.mark.parametrize("heads", [4, 8], ids=["gqa_4_groups", "8_heads"])
def test_tp_reshards_assemble_each_destination_piece(src_tp, dst_tp, heads):
    srcs = _layouts(src_tp, 1, heads)
    dsts = _layouts(dst_tp, 1, heads, first_rank=src_tp)
    plan = _check(srcs, dsts, heads)
    # Merging: a destination hears from exactly the sources whose heads it now holds; splitting: one source each.
    for d in dsts:
        assert len(transfers_for_dst(plan, d.global_rank)) == max(1, src_tp // dst_tp)
    for s in srcs:
        assert len(transfers_for_src(plan, s.global_rank)) == max(1, dst_tp // src_tp)


def test_tp4_to_tp2_moves_only_the_overlapping_heads():
    """GQA with 4 KV groups: TP=4 ranks hold one group each, TP=2 ranks two; rank 4 (heads 0-1) gets group 0
    from rank 0 and group 1 from rank 1, nothing from ranks 2 and 3."""
    plan = plan_kv_reshard(_layouts(4, 1, 4), _layouts(2, 1, 4, first_rank=4))
    assert [(t.src_rank, t.dst_rank, t.global_head_lo, t.global_head_hi) for t in plan] == [
        (0, 4, 0, 1), (1, 4, 1, 2), (2, 5, 2, 3), (3, 5, 3, 4)]
    assert all((t.global_layer_lo, t.global_layer_hi) == (0, LAYERS) for t in plan)


@pytest.mark.parametrize("src, dst", [((1, 2), (1, 3)), ((2, 2), (4, 3)), ((2, 3), (1, 2)), ((4, 1), (2, 4))])
def test_pipeline_and_tensor_changes_together(src, dst):
    srcs = _layouts(*src, heads=8)
    _check(srcs, _layouts(*dst, heads=8, first_rank=len(srcs)), 8)


def test_uneven_explicit_layer_windows():
    """Stages of 5 and 7 attention layers sent to stages of 3, 4 and 5 (as a hybrid model's may be)."""
    srcs = _layouts(2, 2, 8, windows=[(0, 5), (5, 7)])
    _check(srcs, _layouts(1, 3, 8, first_rank=4, windows=[(0, 3), (3, 4), (7, 5)]), 8)


def test_expert_replicas_send_once_from_the_lowest_rank():
    """TP=2 x EP=2 sources hold each KV rectangle twice; only the lower rank of each pair sends."""
    srcs = _layouts(2, 1, 8, ep=2)
    plan = _check(srcs, _layouts(1, 1, 8, first_rank=4), 8)
    assert sorted(t.src_rank for t in plan) == [0, 1]


def test_layout_and_plan_refusals():
    with pytest.raises(ValueError, match=r"num_heads=6 must be divisible by tp_size=4"):
        KVShardLayout(num_layers=4, num_heads=6, tp_size=4, tp_rank=0, pp_size=1, pp_rank=0, global_rank=0)
    with pytest.raises(ValueError, match=r"num_layers=5 must be divisible by pp_size=2"):
        KVShardLayout(num_layers=5, num_heads=4, tp_size=1, tp_rank=0, pp_size=2, pp_rank=0, global_rank=0)
    with pytest.raises(ValueError, match=r"layer_start=1 and num_local_layers=None must be set together"):
        KVShardLayout(num_layers=4, num_heads=4, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, global_rank=0,
                      layer_start=1)
    with pytest.raises(ValueError, match=r"tp_rank=2 must be in \[0, tp_size=2\)"):
        KVShardLayout(num_layers=4, num_heads=4, tp_size=2, tp_rank=2, pp_size=1, pp_rank=0, global_rank=0)
    with pytest.raises(ValueError, match=r"num_heads=8 but destination rank 1 holds num_layers=12, num_heads=4"):
        plan_kv_reshard(_layouts(1, 1, 8), _layouts(1, 1, 4, first_rank=1))
