"""``plan_mamba_reshard``: applied in memory to a known global Mamba state split the way the mixer splits it
(conv channels ``[x | B | C]`` of this rank's heads and groups, SSM state by heads), every destination rank
ends up with exactly its own split, every element written once, and only overlapping bands move."""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.disaggregation.mamba_reshard import (
    MambaShardLayout,
    MambaStateDims,
    plan_mamba_reshard,
)
from megatron_core.inference.disaggregation.utils import intersect, transfers_for_dst

DIMS = MambaStateDims(nheads=8, headdim=3, d_state=2, ngroups=4, d_conv=3)
LAYERS = 6
D_INNER, BC = DIMS.nheads * DIMS.headdim, DIMS.ngroups * DIMS.d_state


def _layouts(tp: int, windows: list[tuple[int, int]], first_rank: int = 0, replicas: int = 1
             ) -> list[MambaShardLayout]:
    """One layout per rank: stages hold the given ``(layer_start, num_layers)``, ranks tp fastest."""
    return [MambaShardLayout(global_rank=first_rank + i, tp_size=tp, tp_rank=i % tp, layer_start=start,
                             num_layers=count, dims=DIMS)
            for i, (start, count) in enumerate(w for w in windows for _ in range(tp * replicas))]


def _global_state() -> tuple[torch.Tensor, torch.Tensor]:
    """``conv [layers, x + B + C channels (global order), d_conv]`` and ``ssm [layers, heads, headdim, d_state]``."""
    conv = torch.arange(LAYERS * (D_INNER + 2 * BC) * DIMS.d_conv, dtype=torch.float32).view(LAYERS, -1, DIMS.d_conv)
    ssm = 1e5 + torch.arange(LAYERS * DIMS.nheads * DIMS.headdim * DIMS.d_state, dtype=torch.float32).view(
        LAYERS, DIMS.nheads, DIMS.headdim, DIMS.d_state)
    return conv, ssm


def _split(conv: torch.Tensor, ssm: torch.Tensor, lay: MambaShardLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's states, as its mixer holds them."""
    lo, hi = lay.layer_range()
    x, b, c = conv[lo:hi].split([D_INNER, BC, BC], dim=1)
    r, tp = lay.tp_rank, lay.tp_size
    local_conv = torch.cat([band.chunk(tp, dim=1)[r] for band in (x, b, c)], dim=1)
    return local_conv, ssm[lo:hi].chunk(tp, dim=1)[r]


def _check(srcs: list[MambaShardLayout], dsts: list[MambaShardLayout]):
    conv, ssm = _global_state()
    plan = plan_mamba_reshard(srcs, dsts)
    split = {s.global_rank: _split(conv, ssm, s) for s in srcs}
    for d in dsts:
        want_conv, want_ssm = _split(conv, ssm, d)
        got = (torch.full_like(want_conv, -1.0), torch.full_like(want_ssm, -1.0))
        writes = (torch.zeros_like(want_conv), torch.zeros_like(want_ssm))
        for t in transfers_for_dst(plan, d.global_rank):
            which = 0 if t.is_conv else 1
            got[which][t.dst_layer, t.dst_lo:t.dst_hi] = split[t.src_rank][which][t.src_layer, t.src_lo:t.src_hi]
            writes[which][t.dst_layer, t.dst_lo:t.dst_hi] += 1
        assert torch.equal(got[0], want_conv) and torch.equal(got[1], want_ssm), f"destination {d.global_rank}"
        assert bool((writes[0] == 1).all()) and bool((writes[1] == 1).all()), "every element written once"
    by_rank = {lay.global_rank: lay for lay in [*srcs, *dsts]}
    for t in plan:  # minimal: each piece is the exact overlap of the pair's shares of its band
        s, d = by_rank[t.src_rank], by_rank[t.dst_rank]
        (s_lo, s_hi), s_off = s.band(t.band)
        (d_lo, d_hi), d_off = d.band(t.band)
        lo, hi = intersect((s_lo, s_hi), (d_lo, d_hi))
        assert (t.src_lo, t.src_hi, t.dst_lo, t.dst_hi) == (s_off + lo - s_lo, s_off + hi - s_lo,
                                                            d_off + lo - d_lo, d_off + hi - d_lo)
    return plan


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1)])
def test_tp_reshards_assemble_each_destination_split(src_tp, dst_tp):
    plan = _check(_layouts(src_tp, [(0, LAYERS)]), _layouts(dst_tp, [(0, LAYERS)], first_rank=src_tp))
    # Every (source, destination) pair with overlapping heads exchanges the 4 bands of every layer, no others.
    pairs = {(t.src_rank, t.dst_rank) for t in plan}
    assert len(plan) == 4 * LAYERS * len(pairs) == 4 * LAYERS * max(src_tp, dst_tp)


def test_tp2_to_tp1_moves_each_band_half_to_its_place():
    """Rank 0 (first half of every band) and rank 1 fill the single TP=1 rank's x, B, C and heads."""
    plan = plan_mamba_reshard(_layouts(2, [(0, 1)]), _layouts(1, [(0, 1)], first_rank=2))
    half_x, half_bc = D_INNER // 2, BC // 2
    assert [(t.src_rank, t.band, t.src_lo, t.src_hi, t.dst_lo, t.dst_hi) for t in plan] == [
        (0, "x", 0, half_x, 0, half_x),
        (0, "B", half_x, half_x + half_bc, D_INNER, D_INNER + half_bc),
        (0, "C", half_x + half_bc, half_x + BC, D_INNER + BC, D_INNER + BC + half_bc),
        (0, "ssm", 0, 4, 0, 4),
        (1, "x", 0, half_x, half_x, D_INNER),
        (1, "B", half_x, half_x + half_bc, D_INNER + half_bc, D_INNER + BC),
        (1, "C", half_x + half_bc, half_x + BC, D_INNER + BC + half_bc, D_INNER + 2 * BC),
        (1, "ssm", 0, 4, 4, 8)]


def test_pipeline_windows_change_with_tensor_parallelism():
    """Two stages of 2 and 4 layers at TP=2 sent to three stages of 2 layers at TP=4."""
    _check(_layouts(2, [(0, 2), (2, 4)]), _layouts(4, [(0, 2), (2, 2), (4, 2)], first_rank=4))


def test_replicas_send_once_from_the_lowest_rank():
    srcs = _layouts(2, [(0, LAYERS)], replicas=2)  # ranks 0-3: tp_rank 0, 1, 0, 1
    plan = _check(srcs, _layouts(1, [(0, LAYERS)], first_rank=4))
    assert {t.src_rank for t in plan} == {0, 1}


def test_layout_and_plan_refusals():
    with pytest.raises(ValueError, match=r"ngroups=4 must be divisible by tp_size=8"):
        MambaShardLayout(0, 8, 0, 0, 1, MambaStateDims(nheads=8, headdim=2, d_state=2, ngroups=4, d_conv=4))
    with pytest.raises(ValueError, match=r"tp_rank=3 must be in \[0, tp_size=2\)"):
        MambaShardLayout(0, 2, 3, 0, 1, DIMS)
    as_dict = MambaShardLayout(0, 2, 1, 0, 1, dict(nheads=8, headdim=3, d_state=2, ngroups=4, d_conv=3))
    assert as_dict.dims == DIMS and as_dict.conv_dim_local == D_INNER // 2 + BC
    other = MambaStateDims(nheads=8, headdim=3, d_state=4, ngroups=4, d_conv=3)
    with pytest.raises(ValueError, match=r"both sides must serve one model"):
        plan_mamba_reshard(_layouts(1, [(0, 1)]), [MambaShardLayout(1, 1, 0, 0, 1, other)])
    with pytest.raises(ValueError, match=r"name='z' must be one of x, B, C, ssm"):
        as_dict.band("z")
