"""The distributed optimizer's parameter all-gather when the gradient sync's Python bookkeeping is skipped.

A full-iteration CUDA graph (``megatron_core.full_cuda_graph``) replays the captured forward-backward, and with it
``finalize_model_grads``' kernels, but none of its Python code: ``finish_grad_sync`` does not run between two
optimizer steps. Without ``overlap_param_gather`` the gather is synchronous, so nothing is left in flight and a
second step must gather again; with it, a gather still dispatched is an error, as before.
"""

from __future__ import annotations

import torch
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


def _two_steps_with_one_finalize(overlap_param_gather: bool) -> dict:
    parallel_state.initialize_model_parallel()
    model = tm.TiedNetTP(tm.make_reference())
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                               overlap_param_gather=overlap_param_gather)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=tm.LR, use_distributed_optimizer=True), [ddp])
    (x, y), = tm.make_data(1)
    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    xm, ym = tm.microbatches(x, y, rank, size)[0]
    ddp.zero_grad_buffer()
    F.mse_loss(ddp(xm.unsqueeze(0)), ym.unsqueeze(0)).backward()
    finalize_model_grads([ddp])
    assert opt.step()[0]
    # The replayed iteration: gradients reduced by kernels, finish_grad_sync's Python reset skipped.
    try:
        assert opt.step()[0]
    except RuntimeError as error:
        return {"error": str(error)}
    ddp.start_param_sync(force_sync=True)
    gathered = [p.detach().clone() for p in model.parameters()]
    return {"error": None, "params": gathered}


def test_a_synchronous_gather_leaves_nothing_dispatched():
    results = run_on_ranks(2, _two_steps_with_one_finalize, False)
    assert [r["error"] for r in results] == [None, None]
    for mine, theirs in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(mine, theirs)  # both ranks hold every updated shard


def _dispatch_twice() -> str:
    parallel_state.initialize_model_parallel()
    model = tm.TiedNetTP(tm.make_reference())
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True), model)
    group = ddp.bucket_groups[0]
    group.start_param_sync()
    try:
        group.start_param_sync()
    except RuntimeError as error:
        return str(error)
    finally:
        group.finish_param_sync(skip_next_bucket_dispatch=True)
    return ""


def test_an_overlapped_gather_still_in_flight_is_refused():
    assert run_on_ranks(2, _dispatch_twice) == ["a parameter all-gather is already dispatched for this bucket group"] * 2
