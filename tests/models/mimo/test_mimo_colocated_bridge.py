"""Colocated ``MimoModel`` with different TP x DP per module equals one process (fp32, gloo, 4 ranks).

Fan-in (encoder TP=1 x DP=4, language model TP=2 x DP=2) and fan-out (encoder TP=2 x DP=2, language model
TP=1 x DP=4): per-token loss, logits and every gradient of the encoder and of the language model (summed
over each module's DP group) against the single-process model on the whole batch. Also the bridge's rank
maps and gather groups, and the errors for layouts it cannot serve.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from megatron_core.hyper_comm_grid import HyperCommGrid
from megatron_core.models.mimo import MimoModel
from megatron_core.models.mimo.comm.colocated_communicator import (
    BridgeDirection,
    ColocatedBridgeCommunicator,
    SliceInfo,
)
from tests.dist_harness import run_on_ranks
from tests.models.mimo import hetero_fixture as h
from tests.models.mimo import mimo_fixture as f

WORLD = 4


def _reference() -> tuple[dict, torch.Tensor, torch.Tensor, dict]:
    state = h.reference_state()
    model = h.make(h.config())
    model.load_state_dict(state, strict=False)
    ids, labels, loss_mask, images = h.global_batch()
    inputs = {"images": {"clip_encoder": {"x": images}}}
    with torch.no_grad():
        logits, _ = model(ids, modality_inputs=inputs)
    loss, _ = model(ids, labels=labels, loss_mask=loss_mask, modality_inputs=inputs)
    (loss * loss_mask).sum().backward()
    return state, loss.detach(), logits, {k: v.grad.detach().clone() for k, v in model.named_parameters()}


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()),
                               msg=lambda m: f"{name}: {m}")


def _check(enc_tp: int, enc_dp: int, lm_tp: int, lm_dp: int) -> tuple[str, int]:
    state, ref_loss, ref_logits, ref_grads = _reference()
    hetero = h.build(enc_tp, enc_dp, lm_tp, lm_dp, state)
    try:
        comm = hetero.model.colocated_comms[("images", "language")]
        ids, labels, loss_mask, inputs, lm_slice = hetero.local_batch()
        with torch.no_grad():
            logits, _ = hetero.model(ids, modality_inputs=inputs)
        if lm_tp > 1:
            pieces = [torch.empty_like(logits) for _ in range(lm_tp)]
            dist.all_gather(pieces, logits.contiguous(), group=hetero.lm_grid.get_pg("tp"))
            logits = torch.cat(pieces, dim=-1)
        _close("logits", logits, ref_logits[lm_slice])
        loss, mask = hetero.model(ids, labels=labels, loss_mask=loss_mask, modality_inputs=inputs)
        _close("loss", loss, ref_loss[lm_slice])
        (loss * mask).sum().backward()
        hetero.sum_grads_over_dp()
        for name, param in hetero.model.named_parameters():
            _close(name, hetero.full(name, param.grad), ref_grads[name])
        return comm.direction.value, len(ref_grads)
    finally:
        h.destroy(hetero)


@pytest.mark.parametrize("layout, direction", [((1, 4, 2, 2), "fan_in"), ((2, 2, 1, 4), "fan_out")])
def test_hetero_dp_matches_single_process(layout, direction):
    results = run_on_ranks(WORLD, _check, *layout)
    assert {r[0] for r in results} == {direction} and results[0][1] > 20


def _maps() -> dict:
    enc, lm = HyperCommGrid([1, 1, 1, 4], h.DIMS), HyperCommGrid([2, 1, 1, 2], h.DIMS)
    cfg = h.config(grid_map={"images": enc, "language": lm})
    model = h.make(cfg)
    comm = model.colocated_comms[("images", "language")]
    out = dict(direction=comm.direction, scale=comm.scale, src=comm.rank_to_src_pos, dest=comm.rank_to_dest_pos,
               groups=comm.gather_group_ranks, slice=comm.get_slice_info(8))
    with pytest.raises(ValueError, match=r"batch dimension 7 is not divisible by the fan_in scale 2"):
        comm.get_slice_info(7)
    model.destroy()
    assert model.colocated_comms == {}
    return out


def test_bridge_rank_maps_gather_groups_and_slices():
    results = run_on_ranks(WORLD, _maps)
    first = results[0]
    assert first["direction"] is BridgeDirection.FAN_IN and first["scale"] == 2
    assert first["src"] == {0: (0, 0), 1: (1, 0), 2: (2, 0), 3: (3, 0)}
    assert first["dest"] == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    assert first["groups"] == [[0, 1], [2, 3]]
    assert [r["slice"] for r in results] == [SliceInfo(0, 4), SliceInfo(4, 4), SliceInfo(0, 4), SliceInfo(4, 4)]


@pytest.mark.parametrize("enc, lm, match", [
    (([1, 1, 1, 4], h.DIMS), ([1, 1, 1, 3], h.DIMS, 1),
     r"'images' -> 'language': grids must span the same ranks; src has 4 ranks from 0, dest 3 from 1"),
    (([1, 1, 1, 4], h.DIMS), ([4], ["tp"]), r"the dest grid needs a 'dp' axis, got dim_names \['tp'\]"),
    (([1, 1, 2, 2], h.DIMS), ([4, 1, 1, 1], h.DIMS),
     r"'images' -> 'language': with different DP sizes \(src dp 2, dest dp 1\) the src grid's pp must be 1"),
    (([1, 2, 1, 2], h.DIMS), ([1, 1, 1, 4], h.DIMS), r"the src grid's cp must be 1, got 2"),
    (([2, 1, 1, 3], h.DIMS), ([3, 1, 1, 2], h.DIMS),
     r"'images' -> 'language': the DP sizes must divide one another, got src dp 3 and dest dp 2"),
])
def test_unsupported_layouts_name_the_grids(monkeypatch, enc, lm, match):
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match=match):
        ColocatedBridgeCommunicator(HyperCommGrid(*enc), HyperCommGrid(*lm), "images", "language")


def test_model_reports_unsupported_colocated_grids(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    grid_map = {"images": HyperCommGrid([1, 1, 8, 1], h.DIMS), "language": HyperCommGrid([2, 1, 1, 4], h.DIMS)}
    with warnings.catch_warnings(), pytest.raises(
            ValueError, match=r"'images' -> 'language': with different DP sizes \(src dp 1, dest dp 4\) the src "
                              r"grid's pp must be 1, got 8"):
        warnings.simplefilter("ignore")
        MimoModel(f.config(grid_map=grid_map))


def test_grids_without_dp_axes_get_no_bridge(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    grid_map = {"images": HyperCommGrid([4], ["tp"]), "language": HyperCommGrid([4], ["tp"])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert MimoModel(f.config(grid_map=grid_map)).colocated_comms == {}


def test_equal_dp_grids_get_an_identity_bridge_without_groups(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    grid_map = {"images": HyperCommGrid([1, 2, 1, 4], h.DIMS), "language": HyperCommGrid([2, 1, 1, 4], h.DIMS)}
    model = h.make(f.config(grid_map=grid_map))
    comm = model.colocated_comms[("images", "language")]
    assert comm.direction is BridgeDirection.EQUAL and comm.gather_pg is None
    x = torch.randn(6, 4, requires_grad=True)
    y = comm.communicate(x)
    y.sum().backward()
    assert torch.equal(y, x) and torch.equal(x.grad, torch.ones_like(x))
    assert comm.get_slice_info(6) == SliceInfo(0, 6)
