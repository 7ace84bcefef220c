"""TorchFullyShardedDataParallel (PyTorch FSDP2) matches single-process training; bad layouts are refused.

DP=2, DP=4, TP=2 x FSDP=2 and DP=2 with full activation recompute: the loss of each of 3 AdamW
steps (library optimizer factory, clipping, scheduler, schedule with ``no_sync``,
``finalize_model_grads``) and every weight afterwards equal the single-process run's (fp32, gloo).
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.distributed import (
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
)
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.dist_harness import run_on_ranks
from tests.distributed import fsdp_gpt as fg
from tests.models.gpt_test_utils import build, gpt2_like, llama_like

RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _check(tp: int, overrides: dict) -> dict:
    initial, ref_losses, ref_weights = fg.reference(**overrides)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        model, opt, sched = fg.build_fsdp(initial, tp, **overrides)
        params = list(model.module.parameters())
        assert all(type(p).__name__ == "DTensor" for p in params)
        dp = parallel_state.get_data_parallel_world_size()
        local = sum(p.to_local().numel() for p in params)
        total = sum(p.numel() for p in params)
        assert local <= -(-total // dp) + len(params), (local, total, dp)  # sharded, not replicated
        losses = [fg.train_step(model, opt, sched, step) for step in range(fg.STEPS)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
        got = fg.full_weights(model, tp)
        assert got.keys() == ref_weights.keys()
        for name, value in got.items():
            torch.testing.assert_close(value, ref_weights[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
        moved = max((ref_weights[n] - initial[n]).abs().max().item() for n in initial)
        assert moved > 1e-3, moved  # training really changed the weights
        return {"dp": dp, "losses": losses}
    finally:
        parallel_state.destroy_model_parallel()


def test_fsdp_dp2_matches_single_process():
    results = run_on_ranks(2, _check, 1, {})
    assert [r["dp"] for r in results] == [2, 2]


def test_fsdp_dp2_with_full_recompute_matches_single_process():
    results = run_on_ranks(2, _check, 1, RECOMPUTE)
    assert results[0]["losses"] == results[1]["losses"]


def test_fsdp_dp4_matches_single_process():
    results = run_on_ranks(4, _check, 1, {})
    assert {r["dp"] for r in results} == {4}


def test_fsdp_tp2_x_dp2_matches_single_process():
    results = run_on_ranks(4, _check, 2, {})
    assert {r["dp"] for r in results} == {2}


def _bad_layouts() -> list[str]:
    messages = []
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        model = build(llama_like(), pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
        with pytest.raises(ValueError, match="pipeline_model_parallel_size=2") as err:
            TorchFullyShardedDataParallel(model.config, TorchFullyShardedDataParallelConfig(), model)
        messages.append(str(err.value))
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    try:
        model = build(gpt2_like())
        with pytest.raises(ValueError, match="share_embeddings_and_output_weights"):
            TorchFullyShardedDataParallel(model.config, TorchFullyShardedDataParallelConfig(), model)
        model = build(llama_like())
        with pytest.raises(ValueError, match="use_distributed_optimizer"):
            TorchFullyShardedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                          model)
        for param in model.decoder.layers[0].mlp.parameters():
            param.allreduce = False
        with pytest.raises(ValueError, match="expert"):
            TorchFullyShardedDataParallel(model.config, TorchFullyShardedDataParallelConfig(), model)
        model = build(llama_like())
        fsdp = TorchFullyShardedDataParallel(model.config, TorchFullyShardedDataParallelConfig(), model)
        with pytest.raises(ValueError, match="use_distributed_optimizer"):
            get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [fsdp])
    finally:
        parallel_state.destroy_model_parallel()
    return messages


def test_fsdp_refuses_layouts_it_cannot_serve():
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        TorchFullyShardedDataParallelConfig(use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="reshard_after_forward"):
        TorchFullyShardedDataParallelConfig(reshard_after_forward=0)
    messages = run_on_ranks(2, _bad_layouts)
    assert "pipeline" in messages[0][0]


def _check_bf16() -> dict:
    initial, ref_losses, _ = fg.reference()
    parallel_state.initialize_model_parallel()
    try:
        model, opt, sched = fg.build_fsdp(initial, 1, bf16=True)
        policy_dtypes = {p.dtype for p in model.module.parameters()}
        losses = [fg.train_step(model, opt, sched, step) for step in range(fg.STEPS)]
        grad_dtypes = {p.grad.dtype for p in model.module.parameters() if p.grad is not None}
        return {"param_dtypes": policy_dtypes, "grad_dtypes": grad_dtypes, "losses": losses, "ref": ref_losses}
    finally:
        parallel_state.destroy_model_parallel()


def test_fsdp_bf16_compute_keeps_fp32_shards_and_tracks_fp32():
    """bf16=True: fp32 sharded params and (fp32-reduced) grads, bf16 compute; losses near the fp32 run."""
    result = run_on_ranks(2, _check_bf16)[0]
    assert result["param_dtypes"] == {torch.float32} and result["grad_dtypes"] == {torch.float32}
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["ref"]), rtol=2e-2, atol=2e-2)
    assert result["losses"] != result["ref"]  # really computed in bf16
