"""The ``fsdp_dtensor`` format with routed experts: saved at EP=2, loaded at EP=1, training continues identically.

Our FSDP2 wrapper refuses expert-parallel parameters, so this runs the format's DistributedDataParallel path
(fp32, ``use_distributed_optimizer=False``). A Mixtral-like MoE GPT trains 2 steps at DP=2 x EP=2 and saves;
loaded at DP=2 x EP=1 into other weights, every expert's weights and AdamW moments (keyed by global expert index)
equal the saved ones and the next step's loss equals the run that never saved. Sequential and grouped experts.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.training import load_checkpoint, save_checkpoint
from megatron_core.transformer.fsdp_dtensor_checkpoint import get_global_unique_param_name
from tests.dist_harness import run_on_ranks
from tests.distributed import fsdp_gpt as fg
from tests.transformer.moe.moe_parallel_utils import build

STEPS, TOL = 2, 1e-6


def _setup(ep: int, grouped: bool, seed: int):
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    model = build("mixtral", expert_model_parallel_size=ep, moe_grouped_gemm=grouped)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(lr=fg.LR, weight_decay=fg.WD, clip_grad=fg.CLIP), [ddp])
    return ddp, opt, fg.scheduler(opt)


def _global_state(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state under its global name (grouped experts split per global expert index),
    gathered from all ranks."""
    inner = model.module
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    local = {}

    def put(name: str, value: torch.Tensor, grouped: bool) -> None:
        if grouped and value.dim():
            for i, expert in enumerate(value):
                local[f"{name}[{ep_rank * value.shape[0] + i}]"] = expert.detach().clone()
        else:
            local[name] = value.detach().clone()

    for sub in opt.chained_optimizers if hasattr(opt, "chained_optimizers") else [opt]:
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                name = get_global_unique_param_name([inner], param)
                grouped = "mlp.experts.linear_fc" in name
                put(name, param, grouped)
                for state_name, value in sub.optimizer.state[param].items():
                    put(f"{name}.{state_name}", value, grouped)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    merged = {}
    for part in gathered:
        merged.update(part)
    return merged


def _source(save_dir: str, grouped: bool) -> dict:
    try:
        model, opt, sched = _setup(2, grouped, seed=7)
        for step in range(STEPS):
            fg.train_step(model, opt, sched, step)
        save_checkpoint(save_dir, STEPS, [model], opt, sched, ckpt_format="fsdp_dtensor")
        state = _global_state(model, opt)
        return {"state": state, "loss": fg.train_step(model, opt, sched, STEPS)}
    finally:
        parallel_state.destroy_model_parallel()


def _load(load_dir: str, grouped: bool) -> dict:
    try:
        model, opt, sched = _setup(1, grouped, seed=8)
        load_checkpoint(load_dir, [model], opt, sched, ckpt_format="fsdp_dtensor")
        state = _global_state(model, opt)
        return {"state": state, "loss": fg.train_step(model, opt, sched, STEPS)}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("grouped", [False, True])
def test_ep2_checkpoint_loads_at_ep1_and_continues(tmp_path, grouped):
    save_dir = str(tmp_path / "ckpt")
    source = run_on_ranks(2, _source, save_dir, grouped)[0]
    got = run_on_ranks(2, _load, save_dir, grouped)[0]
    want = source["state"]
    assert any(("local_experts.3." in k) or ("weight[3]" in k) for k in want)
    assert got["state"].keys() == want.keys()
    for key, value in got["state"].items():
        assert torch.equal(value, want[key]), key
    assert abs(got["loss"] - source["loss"]) < TOL, (got["loss"], source["loss"])
