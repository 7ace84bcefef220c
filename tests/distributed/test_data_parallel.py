"""DP (x TP, x PP) training matches single-process training for plain, overlapped and sharded (ZeRO-1) DDP.

Every rank trains its share of ``TiedNet`` for 5 steps on its slice of the same global batches;
afterwards its parameters (and the clipped gradient norms) must equal the single-process run's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core import parallel_state
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron_core.pipeline_parallel import get_forward_backward_func
from tests.dist_harness import run_on_ranks
from tests.distributed import tiny_models as tm

STEPS = 5

MODES = {
    "plain": {},
    "overlap": {"overlap_grad_reduce": True, "bucket_size": 40},
    "distopt": {"use_distributed_optimizer": True},
    "distopt_overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                        "overlap_param_gather": True, "bucket_size": 40},
    # l1 tagged as expert params (allreduce=False): its own buffers, expert DP group and ChainedOptimizer.
    "expert": {},
    "expert_distopt": {"use_distributed_optimizer": True},
}


def _wrap(module, mode):
    if mode.startswith("expert"):
        for param in module.l1.parameters():
            param.allreduce = False
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


def _train_dp_tp(mode, tp, sequence_parallel=False):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = tm.TiedNetTP(tm.make_reference(), sequence_parallel=sequence_parallel)
    ddp, opt = _wrap(model, mode)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if mode.startswith("expert"):
        assert isinstance(opt, ChainedOptimizer) and len(ddp.expert_parallel_buffers) == 1

    def fwd_bwd(xm, ym):
        if sequence_parallel:  # rows of the microbatch as a [tp, b / tp] "sequence"; each TP rank takes one
            shape = (tp, xm.shape[0] // tp, -1)
            x_local, y_local = xm.view(shape)[tp_rank:tp_rank + 1], ym.view(shape)[tp_rank:tp_rank + 1]
            loss = ((ddp(x_local) - y_local) ** 2).sum() / ym.numel()
        else:
            loss = F.mse_loss(ddp(xm.unsqueeze(0)), ym.unsqueeze(0))
        (loss / tm.NUM_MICROBATCHES).backward()

    norms = [_step_dp(ddp, opt, x, y, fwd_bwd) for x, y in tm.make_data(STEPS)]
    ddp.start_param_sync(force_sync=True)  # overlap_param_gather defers the last gather to the next forward
    return {"params": {k: v.detach().clone() for k, v in model.reference_view().items()}, "norms": norms,
            "tp_rank": tp_rank, "buckets": len(ddp.bucket_groups)}


def _pp_forward_step(data_iterator, model):
    xm, ym = next(data_iterator)
    output = model(xm.unsqueeze(0))

    def loss_func(output_tensor):
        squared = ((output_tensor - ym.unsqueeze(0)) ** 2).sum()
        return squared, torch.tensor(ym.numel()), {"sse": squared.detach()}

    return output, loss_func


def _train_dp_pp(mode, per_token):
    """DP=2 x PP=2 with the 1F1B schedule; finalize_model_grads runs through config.finalize_model_grads_func."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    model = tm.TiedNetStage(tm.make_reference(), parallel_state.is_pipeline_first_stage())
    model.config.calculate_per_token_loss = per_token
    ddp, opt = _wrap(model, mode)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    norms = []
    for x, y in tm.make_data(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        mbs = tm.microbatches(x, y, dp_rank, dp_size)
        forward_backward(forward_step_func=_pp_forward_step, data_iterator=iter(mbs), model=[ddp],
                         num_microbatches=len(mbs), seq_length=1, micro_batch_size=mbs[0][0].shape[0])
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
    ddp.start_param_sync(force_sync=True)
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


@pytest.mark.parametrize("mode", [m for m in MODES if not m.startswith("expert")])
def test_dp2_matches_single_process(mode):
    results = run_on_ranks(2, _train_dp_tp, mode, 1)
    _check(results)
    if "overlap" in mode:
        assert results[0]["buckets"] > 2


@pytest.mark.parametrize("mode", list(MODES))
def test_dp4_matches_single_process(mode):
    _check(run_on_ranks(4, _train_dp_tp, mode, 1))


@pytest.mark.parametrize("mode,sequence_parallel", [("plain", False), ("distopt_overlap", False),
                                                    ("overlap", True), ("distopt", True)])
def test_dp2_tp2_matches_single_process(mode, sequence_parallel):
    _check(run_on_ranks(4, _train_dp_tp, mode, 2, sequence_parallel), tp=2)


@pytest.mark.parametrize("mode,per_token", [("plain", False), ("overlap", True), ("distopt", False),
                                            ("distopt_overlap", True)])
def test_dp2_pp2_matches_single_process(mode, per_token):
    _check(run_on_ranks(4, _train_dp_pp, mode, per_token))
