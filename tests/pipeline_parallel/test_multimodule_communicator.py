"""MultiModulePipelineCommunicator / BridgeCommunicator on gloo ranks, against one process running every module.

An "encoder" (per-token MLP, optionally split over two pipeline stages) feeds a "language model" (a linear
layer and a squared-error loss) on other ranks. Two microbatches run in 1F1B order through the
communicator's dict API; the language model's loss and every parameter gradient must equal a
single-process run of both modules on the whole batch. DP gradients are reduced as the bridge implies:
the encoder's by sum over its replicas divided by the language model's DP size (each language replica's
mean loss already covers the samples it received), the language model's by mean.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_core.hyper_comm_grid import HyperCommGrid
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.pipeline_parallel.bridge_communicator import BridgeCommunicator, CommRole
from megatron_core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator
from megatron_core.process_groups_config import MultiModuleProcessGroupCollection, ProcessGroupCollection
from tests.dist_harness import run_on_ranks

S, B, D_IN, D_MID, H, N_MB = 3, 4, 5, 6, 4, 2
ATOL = 1e-5


def _models() -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(1234)
    enc0 = torch.nn.Sequential(torch.nn.Linear(D_IN, D_MID), torch.nn.Tanh())
    enc1 = torch.nn.Linear(D_MID, H)
    llm = torch.nn.Linear(H, H)
    return enc0, enc1, llm


def _data() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per microbatch: inputs [B, S, D_IN] and targets [B, S, H] (sample-major)."""
    g = torch.Generator().manual_seed(7)
    return ([torch.randn(B, S, D_IN, generator=g) for _ in range(N_MB)],
            [torch.randn(B, S, H, generator=g) for _ in range(N_MB)])


def _loss(out_bsh: torch.Tensor, target_bsh: torch.Tensor) -> torch.Tensor:
    return ((out_bsh - target_bsh) ** 2).mean() / N_MB


def _reference() -> tuple[float, dict[str, list[torch.Tensor]]]:
    enc0, enc1, llm = _models()
    xs, ts = _data()
    total = 0.0
    for x, t in zip(xs, ts):
        loss = _loss(llm(enc1(enc0(x))), t)
        loss.backward()
        total += loss.item()
    return total, {name: [p.grad.clone() for p in m.parameters()] for name, m in
                   (("enc0", enc0), ("enc1", enc1), ("llm", llm))}


def _grid(shape: list[int], offset: int) -> HyperCommGrid:
    grid = HyperCommGrid(shape, ["tp", "cp", "pp", "dp"], rank_offset=offset)
    for dims in ("tp", "pp", "dp"):
        grid.create_pg(dims)
    return grid


def _layout(name: str) -> dict:
    """Grids (tp, cp, pp, dp) and tensor layout of each scenario."""
    return {
        # 2 ranks: encoder {0} -> llm {1}; [B, S, H] with the default dim_mapping.
        "pair": dict(enc=([1, 1, 1, 1], 0), llm=([1, 1, 1, 1], 1), dim_mapping=None, ndim=3),
        # 4 ranks: encoder DP 2 {0, 1} -> llm TP 2, DP 1 {2, 3}: fan-in, then broadcast to the TP peer; [S, B, H].
        "fan_in": dict(enc=([1, 1, 1, 2], 0), llm=([2, 1, 1, 1], 2), dim_mapping={"s": 0, "b": 1, "h": 2}, ndim=3),
        # 4 ranks: encoder PP 2 {0, 1} -> llm DP 2 {2, 3}: intra-module P2P, fan-out; 2-D [B*S, H] outputs.
        "fan_out": dict(enc=([1, 1, 2, 1], 0), llm=([1, 1, 1, 2], 2), dim_mapping=None, ndim=2),
    }[name]


def _to_wire(y_bsh: torch.Tensor, lay: dict) -> torch.Tensor:
    if lay["ndim"] == 2:
        return y_bsh.reshape(-1, y_bsh.shape[-1])
    return y_bsh.transpose(0, 1).contiguous() if lay["dim_mapping"] else y_bsh


def _from_wire(x: torch.Tensor, lay: dict) -> torch.Tensor:
    if lay["ndim"] == 2:
        return x.reshape(-1, S, x.shape[-1])
    return x.transpose(0, 1) if lay["dim_mapping"] else x


def _run_scenario(name: str) -> dict:
    lay = _layout(name)
    rank = dist.get_rank()
    enc_grid, llm_grid = _grid(*lay["enc"]), _grid(*lay["llm"])
    config = ModelParallelConfig(pipeline_dtype=torch.float32)
    comm = MultiModulePipelineCommunicator(
        {"encoder": enc_grid, "llm": llm_grid}, {"encoder": ["llm"], "llm": []}, config,
        dim_mapping=lay["dim_mapping"], module_output_ndim={"encoder": lay["ndim"]},
    )
    enc0, enc1, llm = _models()
    xs, ts = _data()
    enc_dp, llm_dp = enc_grid.shape[3], llm_grid.shape[3]
    result: dict = {"rank": rank, "first": comm.is_pp_first_stage, "last": comm.is_pp_last_stage,
                    "stage": comm.current_stage, "total": comm.total_stages}
    try:
        if comm.is_current_rank_in_grid(enc_grid):
            dp_group = enc_grid.get_pg("dp")
            share = B // enc_dp
            lo = dist.get_group_rank(dp_group, rank) * share
            local_x = [x[lo:lo + share] for x in xs]
            pp_rank = comm.rank_module_map["encoder"].pp_rank
            pp_size = comm.rank_module_map["encoder"].pp_size
            if pp_size == 2 and pp_rank == 0:
                mid = [enc0(x) for x in local_x]
                for m in mid:
                    comm.send_forward({"encoder": m.reshape(-1, D_MID)})
                for m in mid:
                    g = comm.recv_backward(tensor_shape=(share * S, D_MID, 1))["encoder"]
                    m.reshape(-1, D_MID).backward(g)
                params = {"enc0": enc0}
            else:
                if pp_size == 2:
                    ins = [comm.recv_forward(tensor_shape=(share * S, D_MID, 1))["encoder"] for _ in range(N_MB)]
                    body = [lambda i=i: enc1(ins[i].reshape(share, S, D_MID)) for i in range(N_MB)]
                    params = {"enc1": enc1}
                else:
                    ins = [None] * N_MB
                    body = [lambda i=i: enc1(enc0(local_x[i])) for i in range(N_MB)]
                    params = {"enc0": enc0, "enc1": enc1}
                y0 = _to_wire(body[0](), lay)
                comm.send_forward({"encoder": y0})
                y1 = _to_wire(body[1](), lay)
                g0 = comm.send_forward_recv_backward({"encoder": y1})["encoder"]
                y0.backward(g0)
                y1.backward(comm.recv_backward()["encoder"])
                if pp_size == 2:
                    result["sent_grad_shapes"] = [tuple(t.grad.shape) for t in ins]
                    comm.send_backward({"encoder": ins[0].grad})
                    comm.send_backward({"encoder": ins[1].grad})
            for module in params.values():
                for p in module.parameters():
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad /= llm_dp
            result["grads"] = {k: [p.grad for p in m.parameters()] for k, m in params.items()}
        else:
            dp_group = llm_grid.get_pg("dp")
            share = B // llm_dp
            lo = dist.get_group_rank(dp_group, rank) * share
            local_t = [t[lo:lo + share] for t in ts]
            received = comm.recv_forward()
            assert list(received) == ["encoder"], received
            x0 = received["encoder"]
            loss0 = _loss(llm(_from_wire(x0, lay)), local_t[0])
            loss0.backward()
            x1 = comm.send_backward_recv_forward({"encoder": x0.grad})["encoder"]
            loss1 = _loss(llm(_from_wire(x1, lay)), local_t[1])
            loss1.backward()
            comm.send_backward({"encoder": x1.grad})
            loss = torch.tensor(loss0.item() + loss1.item())
            dist.all_reduce(loss, group=dp_group)
            result["loss"] = loss.item() / llm_dp
            result["recv_shape"] = tuple(x0.shape)
            result["leaf"] = x0.is_leaf and x0.requires_grad
            for p in llm.parameters():
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= llm_dp
            result["grads"] = {"llm": [p.grad for p in llm.parameters()]}
        result["roles"] = [b.comm_map[rank].role.value for b in comm.bridge_comms]
    finally:
        dist.barrier()
        BridgeCommunicator.destroy_broadcast_pgs()
        BridgeCommunicator.destroy_bridge_pgs()
        enc_grid.destroy()
        llm_grid.destroy()
    return result


def _check_against_reference(results: list[dict]) -> None:
    ref_loss, ref_grads = _reference()
    losses = [r["loss"] for r in results if "loss" in r]
    assert losses
    for loss in losses:
        assert abs(loss - ref_loss) < ATOL, (loss, ref_loss)
    seen = set()
    for r in results:
        for name, grads in r["grads"].items():
            seen.add(name)
            for got, want in zip(grads, ref_grads[name]):
                torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert seen == {"enc0", "enc1", "llm"}


def test_two_ranks_encoder_to_llm_matches_single_process():
    results = run_on_ranks(2, _run_scenario, "pair")
    _check_against_reference(results)
    assert [(r["first"], r["last"], r["stage"], r["total"]) for r in results] == [(True, False, 0, 2), (False, True, 1, 2)]
    assert [r["roles"] for r in results] == [["SENDER"], ["RECEIVER"]]
    assert results[1]["recv_shape"] == (B, S, H) and results[1]["leaf"]


def test_four_ranks_fan_in_to_tensor_parallel_llm():
    results = run_on_ranks(4, _run_scenario, "fan_in")
    _check_against_reference(results)
    # Both encoder replicas send to the one LLM leader (rank 2); rank 3 gets the batch by broadcast.
    assert [r["roles"] for r in results] == [["SENDER"], ["SENDER"], ["RECEIVER"], ["MEMBER"]]
    assert results[2]["recv_shape"] == results[3]["recv_shape"] == (S, B, H)
    assert results[3]["loss"] == pytest.approx(results[2]["loss"], abs=0)


def test_four_ranks_pipelined_encoder_fan_out_2d():
    results = run_on_ranks(4, _run_scenario, "fan_out")
    _check_against_reference(results)
    # Encoder stage 1 (rank 1) splits its [B*S, H] output between the two LLM replicas.
    assert [r["roles"] for r in results] == [["MEMBER"], ["SENDER"], ["RECEIVER"], ["RECEIVER"]]
    assert results[2]["recv_shape"] == results[3]["recv_shape"] == (B // 2 * S, H)
    assert results[1]["sent_grad_shapes"] == [(B * S, D_MID)] * 2
    assert [(r["stage"], r["total"]) for r in results] == [(0, 3), (1, 3), (2, 3), (2, 3)]


def _pg_collections() -> dict:
    rank = dist.get_rank()
    enc_grid, llm_grid = _grid([1, 1, 1, 1], 0), _grid([1, 1, 1, 1], 1)
    try:
        module_pgs = {}
        for name, grid in (("encoder", enc_grid), ("llm", llm_grid)):
            if grid.is_current_rank_in_grid():
                module_pgs[name] = ProcessGroupCollection(tp=grid.get_pg("tp"), pp=grid.get_pg("pp"),
                                                          dp=grid.get_pg("dp"))
        lm = "llm" if "llm" in module_pgs else None
        pgs = MultiModuleProcessGroupCollection(module_pgs=module_pgs, language_model_module_name=lm)
        out = {"rank": rank, "keys": list(pgs.keys()), "has_lm": pgs.has_language_model(), "len": len(pgs),
               "repr": repr(pgs), "pp_ranks": [dist.get_process_group_ranks(c.pp) for c in pgs]}
        if pgs.has_language_model():
            out["cp"] = pgs.get_language_model_cp_size()
            assert pgs.get_language_model_collection() is module_pgs["llm"] is pgs["llm"]
        else:
            with pytest.raises(ValueError, match="language_model_module_name is None"):
                pgs.get_language_model_cp_size()
        return out
    finally:
        enc_grid.destroy()
        llm_grid.destroy()


def test_multimodule_pg_collection_membership_on_two_ranks():
    r0, r1 = run_on_ranks(2, _pg_collections)
    assert (r0["keys"], r0["has_lm"], r0["pp_ranks"]) == (["encoder"], False, [[0]])
    assert (r1["keys"], r1["has_lm"], r1["pp_ranks"], r1["cp"]) == (["llm"], True, [[1]], 1)
    assert r0["repr"] == "MultiModuleProcessGroupCollection(modules=[encoder])"
    assert r1["repr"] == "MultiModuleProcessGroupCollection(modules=[llm], language_model_module_name='llm')"


def test_multimodule_pg_collection_validation():
    enc, llm = ProcessGroupCollection(), ProcessGroupCollection()
    with pytest.raises(ValueError, match="module_pgs must name at least one module"):
        MultiModuleProcessGroupCollection(module_pgs={})
    with pytest.raises(ValueError, match=r"language_model_module_name 'lm' is not a key of module_pgs \['enc'\]"):
        MultiModuleProcessGroupCollection(module_pgs={"enc": enc}, language_model_module_name="lm")
    pgs = MultiModuleProcessGroupCollection(module_pgs={"enc": enc, "llm": llm}, language_model_module_name="llm")
    assert len(pgs) == 2 and list(pgs) == [enc, llm] and dict(pgs.items()) == {"enc": enc, "llm": llm}
    assert pgs.get_module_collection("enc") is enc and pgs.get_language_model_cp_size() == 1
    with pytest.raises(ValueError, match=r"module 'vision' is not in module_pgs; available: \['enc', 'llm'\]"):
        pgs.get_module_collection("vision")


def test_compute_total_pipeline_stages(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    grids = {
        "image": HyperCommGrid([1, 1, 1, 1], ["tp", "cp", "pp", "dp"], rank_offset=0),
        "audio": HyperCommGrid([1, 1, 1, 1], ["tp", "cp", "pp", "dp"], rank_offset=1),
        "llm": HyperCommGrid([2, 1, 2, 1], ["tp", "cp", "pp", "dp"], rank_offset=2),
        "generator": HyperCommGrid([1, 1, 1, 2], ["tp", "cp", "pp", "dp"], rank_offset=6),
    }
    topo = {"image": ["llm"], "audio": ["llm"], "llm": ["generator"], "generator": []}
    total = MultiModulePipelineCommunicator.compute_total_pipeline_stages
    assert total(topo, grids) == 4
    assert [total(topo, grids, rank=r, module_name="llm") for r in (2, 3, 4, 5)] == [2, 2, 3, 3]
    assert total(topo, grids, rank=7, module_name="generator") == 4
    with pytest.raises(ValueError, match="cycle"):
        total({"image": ["llm"], "audio": [], "llm": ["image"], "generator": []}, grids, rank=2, module_name="llm")
    with pytest.raises(ValueError, match="rank 0 is not in the grid of module 'llm'"):
        total(topo, grids, rank=0, module_name="llm")


def test_split_at_batch_dim_follows_split_metadata():
    fake = SimpleNamespace(_batch_dim=0)
    t = torch.arange(10.0).reshape(10, 1)
    t._mimo_bridge_split_sizes = [1, 2, 3, 4]
    parts = BridgeCommunicator._split_tensor_at_batch_dim(fake, t, 2)
    assert [p.shape[0] for p in parts] == [3, 7] and torch.equal(torch.cat(parts), t)
    even = BridgeCommunicator._split_tensor_at_batch_dim(fake, torch.zeros(6, 2), 3)
    assert [p.shape[0] for p in even] == [2, 2, 2]
    with pytest.raises(ValueError, match="sums to 10, the batch axis has 9"):
        u = torch.zeros(9, 1)
        u._mimo_bridge_split_sizes = [5, 5]
        BridgeCommunicator._split_tensor_at_batch_dim(fake, u, 2)
    assert CommRole("SENDER") is CommRole.SENDER
