"""Megatron-FSDP's ``FullyShardedDataParallel`` trains like single-process training and like the wrapper each
sharding strategy maps onto.

For every ``data_parallel_sharding_strategy`` at DP=2 (and TP=2 x DP=2, and HSDP with two optimizer instances):
the loss of each of 3 AdamW steps and every weight afterwards equal the single-process run's (fp32, gloo,
1e-5) and equal, bit for bit, the same run through ``DistributedDataParallel`` (+ distributed optimizer) or
``TorchFullyShardedDataParallel`` built by hand.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state
from megatron_core._ground import unwrap_model
from megatron_core.distributed import DistributedDataParallel, TorchFullyShardedDataParallel
from megatron_core.optimizer import DistributedOptimizer
from megatron_core.tensor_parallel.random import get_cuda_rng_tracker
from megatron_core.transformer.module import MegatronModule
from tests.dist_harness import run_on_ranks
from tests.distributed import fsdp_gpt as fg
from tests.distributed import megatron_fsdp_gpt as mg

ENGINES = {"no_shard": DistributedDataParallel, "optim": DistributedDataParallel,
           "optim_grads": DistributedDataParallel, "optim_grads_params": TorchFullyShardedDataParallel}


def _train(model, opt, sched) -> list[float]:
    return [fg.train_step(model, opt, sched, step) for step in range(fg.STEPS)]


def _check(strategy: str, tp: int, instances: int = 1, optimizer_flag: bool = True) -> dict:
    initial, ref_losses, ref_weights = fg.reference()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             num_distributed_optimizer_instances=instances)
    try:
        fields = {"num_distributed_optimizer_instances": instances} if instances > 1 else {}
        model, opt, sched = mg.build_adapter(initial, tp, strategy, optimizer_flag, **fields)
        tracker = {k: v.tolist() for k, v in get_cuda_rng_tracker().get_states().items()}  # TP rank 0's (0.19)
        assert type(model.module) is ENGINES[strategy]
        assert isinstance(unwrap_model(model), (MegatronModule, TorchFullyShardedDataParallel))
        assert isinstance(opt, DistributedOptimizer) == (strategy in ("optim", "optim_grads"))
        losses = _train(model, opt, sched)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
        weights = mg.full_weights(model, tp)
        assert weights.keys() == ref_weights.keys()
        for name, value in weights.items():
            torch.testing.assert_close(value, ref_weights[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
        moved = max((ref_weights[n] - initial[n]).abs().max().item() for n in initial)
        assert moved > 1e-3, moved
        if instances == 1:
            direct, dopt, dsched = mg.build_direct(initial, tp, strategy)
            assert _train(direct, dopt, dsched) == losses
            direct_weights = mg.full_weights(direct, tp)
            for name, value in weights.items():
                assert torch.equal(value, direct_weights[name]), name
        return {"losses": losses, "overlap": model.ddp_config.overlap_grad_reduce, "tracker": tracker}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("strategy", mg.STRATEGIES)
def test_megatron_fsdp_dp2_matches_single_process_and_plain_wrapper(strategy: str):
    results = run_on_ranks(2, _check, strategy, 1)
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["overlap"] == (strategy in ("optim_grads", "optim_grads_params"))  # 0.19 turns it on


def test_megatron_fsdp_strategy_decides_the_optimizer_not_the_flag():
    """OptimizerConfig.use_distributed_optimizer=False with ``optim``: still the distributed optimizer."""
    run_on_ranks(2, _check, "optim", 1, 1, False)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_megatron_fsdp_tp2_x_dp2_matches_single_process(strategy: str):
    results = run_on_ranks(4, _check, strategy, 2)
    assert results[0]["tracker"] == results[1]["tracker"] and results[0]["tracker"]  # synced over TP ranks 0, 1


def test_megatron_fsdp_hsdp_two_optimizer_instances_matches_single_process():
    run_on_ranks(4, _check, "optim_grads", 1, 2)
