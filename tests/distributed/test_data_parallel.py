"""DP (x TP, x PP) training matches single-process training for plain, overlapped and sharded (ZeRO-1) DDP.

Every rank trains its share of ``TiedNet`` for 5 steps on its slice of the same global batches;
afterwards its parameters (and the clipped gradient norms) must equal the single-process run's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import parallel_state
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.dist_harness import run_on_ranks
from tests.distributed import tiny_models as tm

STEPS = 5

MODES = {
    "plain": {},
    "overlap": {"overlap_grad_reduce": True, "bucket_size": 40},
    "distopt": {"use_distributed_optimizer": True},
    "distopt_overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                        "overlap_param_gather": True, "bucket_size": 40},
}


def _wrap(module, mode):
    ddp_config = DistributedDataParallelConfig(**MODES[mode])
    ddp = DistributedDataParallel(module.config, ddp_config, module)
    opt = get_megatron_optimizer(
        OptimizerConfig(lr=tm.LR, weight_decay=tm.WD, clip_grad=tm.CLIP,
                        use_distributed_optimizer=ddp_config.use_distributed_optimizer), [ddp])
    return ddp, opt


def _step_dp(ddp, opt, x, y, forward_backward):
    ddp.zero_grad_buffer()
    opt.zero_grad()
    mbs = tm.microbatches(x, y, parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size())
    for i, (xm, ym) in enumerate(mbs):
        if i < len(mbs) - 1:
            with ddp.no_sync():
                forward_backward(xm, ym)
        else:
            forward_backward(xm, ym)
    finalize_model_grads([ddp])
    ok, norm, _ = opt.step()
    assert ok
    return norm


def _train_dp_tp(mode, tp):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = tm.TiedNetTP(tm.make_reference())
    ddp, opt = _wrap(model, mode)

    def fwd_bwd(xm, ym):
        (F.mse_loss(ddp(xm), ym) / tm.NUM_MICROBATCHES).backward()

    norms = [_step_dp(ddp, opt, x, y, fwd_bwd) for x, y in tm.make_data(STEPS)]
    ddp.start_param_sync(force_sync=True)  # overlap_param_gather defers the last gather to the next forward
    n_buckets = len(ddp.bucket_groups)
    return {"params": {k: v.detach().clone() for k, v in model.reference_view().items()}, "norms": norms,
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(), "buckets": n_buckets}


def _train_dp_pp(mode):
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    first = parallel_state.is_pipeline_first_stage()
    model = tm.TiedNetStage(tm.make_reference(), first)
    ddp, opt = _wrap(model, mode)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    peer = parallel_state.get_pipeline_model_parallel_next_rank() if first else \
        parallel_state.get_pipeline_model_parallel_prev_rank()
    batch = tm.GLOBAL_BATCH // parallel_state.get_data_parallel_world_size() // tm.NUM_MICROBATCHES

    def fwd_bwd(xm, ym):
        if first:
            h = ddp(xm)
            dist.send(h.detach().contiguous(), peer, group=pp_group)
            grad = torch.empty_like(h)
            dist.recv(grad, peer, group=pp_group)
            h.backward(grad)
        else:
            h = torch.empty(batch, tm.HIDDEN)
            dist.recv(h, peer, group=pp_group)
            h.requires_grad_(True)
            (F.mse_loss(ddp(h), ym) / tm.NUM_MICROBATCHES).backward()
            dist.send(h.grad.contiguous(), peer, group=pp_group)

    norms = [_step_dp(ddp, opt, x, y, fwd_bwd) for x, y in tm.make_data(STEPS)]
    ddp.start_param_sync(force_sync=True)  # overlap_param_gather defers the last gather to the next forward
    return {"params": {k: v.detach().clone() for k, v in model.reference_view().items()}, "norms": norms,
            "tp_rank": 0, "buckets": len(ddp.bucket_groups)}


_REFERENCE: dict = {}


def _reference():
    if not _REFERENCE:
        _REFERENCE["params"], _REFERENCE["norms"] = tm.train_reference(STEPS)
    return _REFERENCE["params"], _REFERENCE["norms"]


def _check(results, tp=1):
    ref_params, ref_norms = _reference()
    for result in results:
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
        for name, value in result["params"].items():
            expected = ref_params[name]
            if value.shape != expected.shape:  # a TP shard: l1 split on dim 0, l2 weight on dim 1
                dim = 1 if name == "l2.weight" else 0
                expected = expected.chunk(tp, dim=dim)[result["tp_rank"]]
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mode", list(MODES))
def test_dp2_matches_single_process(mode):
    results = run_on_ranks(2, _train_dp_tp, mode, 1)
    _check(results)
    if "overlap" in mode:
        assert results[0]["buckets"] > 2


@pytest.mark.parametrize("mode", list(MODES))
def test_dp4_matches_single_process(mode):
    _check(run_on_ranks(4, _train_dp_tp, mode, 1))


@pytest.mark.parametrize("mode", ["plain", "distopt_overlap"])
def test_dp2_tp2_matches_single_process(mode):
    _check(run_on_ranks(4, _train_dp_tp, mode, 2), tp=2)


@pytest.mark.parametrize("mode", ["plain", "overlap", "distopt"])
def test_dp2_pp2_matches_single_process(mode):
    _check(run_on_ranks(4, _train_dp_pp, mode))
