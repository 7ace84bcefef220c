"""Clipping of a ``ChainedOptimizer`` (dense + expert) folded into its sub-optimizers' flat steps.

The flat Adam step of the distributed optimizer reads the bf16 gradient buffers, not the main params' gradients,
so clipping the latter (the chain's unfolded path) never reached it. On 2 CPU ranks with the flat step forced on,
the chain folds clipping into every sub-optimizer's step: each receives the one global factor
``max(1, (norm + 1e-6) / clip_grad)``, the norm being the chain's global norm, and training then matches the
per-tensor step with clipping applied. On one GPU (one NCCL rank) the flat step is the default, bf16 gradient buffers
and all, and the same holds.
"""

from __future__ import annotations

import math

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
from megatron_core.optimizer.distrib_optimizer import DistributedOptimizer
from tests.cuda_process_group import one_rank_nccl_group
from tests.dist_harness import run_on_ranks
from tests.distributed import tiny_models as tm

CLIP = 1e-3  # below the gradient norm: every step clips
STEPS = 3


def _train(flat: bool | None, device: str = "cpu") -> dict:
    """Train the chain for ``STEPS`` steps (``flat``: the flat step forced on / off, ``None``: the default for
    ``device``); its norms, losses, weights and the clip factors each flat step received."""
    if device == "cpu":
        parallel_state.initialize_model_parallel()
    try:
        model = tm.TiedNetTP(tm.make_reference()).to(device=device, dtype=torch.bfloat16)
        for param in model.l1.parameters():
            param.allreduce = False  # an expert param: the optimizer becomes a chain of two
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=False, use_distributed_optimizer=True), model)
        previous = DistributedOptimizer.flat_shard_step
        DistributedOptimizer.flat_shard_step = flat
        try:
            opt = get_megatron_optimizer(OptimizerConfig(lr=tm.LR, weight_decay=tm.WD, clip_grad=CLIP, bf16=True,
                                                         use_distributed_optimizer=True), [ddp])
        finally:
            DistributedOptimizer.flat_shard_step = previous
        assert isinstance(opt, ChainedOptimizer) and len(opt.chained_optimizers) == 2
        factors: list[list[float]] = []
        for sub in opt.chained_optimizers:
            if sub._flat is not None:
                step = sub._flat.step

                def spy(grad_scale=None, found_inf=None, step=step):
                    factors.append([None if grad_scale is None else float(grad_scale)])
                    return step(grad_scale, found_inf)

                sub._flat.step = spy
        norms, losses = [], []
        for x, y in tm.make_data(STEPS):
            ddp.zero_grad_buffer()
            rank, world = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
            mbs = tm.microbatches(x, y, rank, world)
            total = 0.0
            for xm, ym in mbs:
                xm, ym = xm.to(device), ym.to(device)
                loss = F.mse_loss(ddp(xm.unsqueeze(0).to(torch.bfloat16)).float(), ym.unsqueeze(0)) / len(mbs)
                loss.backward()
                total += loss.item()
            finalize_model_grads([ddp])
            success, norm, _ = opt.step()
            assert success
            norms.append(norm)
            losses.append(total)
        return {"fold": opt._fold_clipping_into_adam(), "flat": [s._flat is not None for s in opt.chained_optimizers],
                "factors": factors, "norms": norms, "losses": losses,
                "weights": {k: v.detach().float().clone() for k, v in model.named_parameters()}}
    finally:
        if device == "cpu":
            parallel_state.destroy_model_parallel()


def _check_folded(flat: dict, per_tensor: dict) -> None:
    """``flat`` received the global clip factor in every sub-optimizer's step and trained as ``per_tensor``."""
    assert flat["flat"] == [True, True] and flat["fold"]
    assert len(flat["factors"]) == 2 * STEPS
    for step, norm in enumerate(flat["norms"]):
        assert norm > CLIP
        want = (norm + 1e-6) / CLIP
        for (factor,) in flat["factors"][2 * step:2 * step + 2]:
            assert factor is not None and math.isclose(factor, want, rel_tol=1e-5), (step, factor, want)
    # The same clipped training as the per-tensor step (which clips the main gradients), to bf16 rounding.
    assert per_tensor["flat"] == [False, False]
    for a, b in zip(flat["norms"], per_tensor["norms"]):
        assert math.isclose(a, b, rel_tol=1e-3), (flat["norms"], per_tensor["norms"])
    for name, weight in flat["weights"].items():
        torch.testing.assert_close(weight, per_tensor["weights"][name], rtol=1.6e-2, atol=1e-4, msg=name)


def test_chain_folds_one_global_clip_factor_into_every_flat_step():
    for flat, per_tensor in zip(run_on_ranks(2, _train, True), run_on_ranks(2, _train, False)):
        _check_folded(flat, per_tensor)


@pytest.mark.gpu
def test_chain_folds_clipping_into_the_default_flat_step_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with one_rank_nccl_group(tmp_path):
        flat = _train(None, "cuda")
        per_tensor = _train(False, "cuda")
    _check_folded(flat, per_tensor)
