"""Checkpoints move between TorchFullyShardedDataParallel and DDP + distributed optimizer, exactly.

FSDP at DP=4 trains 3 steps and saves (model, AdamW moments, scheduler). DDP with the distributed
optimizer at TP=2 x DP=2 loads it: its weights equal the FSDP weights bit for bit, and its re-saved
checkpoint holds exactly the same global tensors. FSDP at TP=2 x DP=2 loads that one back: same
weights, same tensors, and its next training step has the loss the source run had at that step.
"""

from __future__ import annotations

import torch

from megatron_core import parallel_state
from megatron_core.dist_checkpointing import load_plain_tensors
from megatron_core.training import get_checkpoint_name, load_checkpoint, save_checkpoint
from tests.dist_harness import run_on_ranks
from tests.distributed import fsdp_gpt as fg

WORLD = 4


def _source(save_dir: str) -> tuple[dict, float]:
    initial, _, _ = fg.reference(steps=0)
    parallel_state.initialize_model_parallel()
    try:
        model, opt, sched = fg.build_fsdp(initial, 1)
        for step in range(fg.STEPS):
            fg.train_step(model, opt, sched, step)
        save_checkpoint(save_dir, fg.STEPS, [model], opt, sched)
        weights = fg.full_weights(model, 1)
        return weights, fg.train_step(model, opt, sched, fg.STEPS)
    finally:
        parallel_state.destroy_model_parallel()


def _load(kind: str, load_dir: str, save_dir: str) -> tuple[dict, float]:
    other, _, _ = fg.reference(steps=0, init_method_std=0.05)  # weights the checkpoint must overwrite
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        if kind == "ddp":
            model, opt, sched = fg.build_ddp(2)
        else:
            model, opt, sched = fg.build_fsdp(other, 2)
        state = load_checkpoint(load_dir, [model], opt, sched)
        assert state["iteration"] == fg.STEPS
        assert sched.num_steps == fg.STEPS
        save_checkpoint(save_dir, fg.STEPS, [model], opt, sched)
        weights = fg.full_weights(model, 2)
        return weights, fg.train_step(model, opt, sched, fg.STEPS)
    finally:
        parallel_state.destroy_model_parallel()


def _same_tensors(a_dir: str, b_dir: str) -> None:
    a = load_plain_tensors(get_checkpoint_name(a_dir, fg.STEPS))
    b = load_plain_tensors(get_checkpoint_name(b_dir, fg.STEPS))
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    assert {k.split(".")[2] for k in a if k.startswith("optimizer.state.")} == {"exp_avg", "exp_avg_sq"}
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def _same_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in got.items():
        assert torch.equal(value, want[name]), name


def test_fsdp_checkpoint_loads_under_ddp_distributed_optimizer_and_back(tmp_path):
    fsdp_dir, ddp_dir, back_dir = (str(tmp_path / n) for n in ("fsdp_dp4", "ddp_tp2", "fsdp_tp2"))
    source = run_on_ranks(WORLD, _source, fsdp_dir)
    weights, next_loss = source[0]
    ddp = run_on_ranks(WORLD, _load, "ddp", fsdp_dir, ddp_dir)
    _same_weights(ddp[0][0], weights)
    _same_tensors(fsdp_dir, ddp_dir)
    back = run_on_ranks(WORLD, _load, "fsdp", ddp_dir, back_dir)
    _same_weights(back[0][0], weights)
    _same_tensors(fsdp_dir, back_dir)
    for _, loss in ddp + back:
        assert abs(loss - next_loss) < 1e-5, (loss, next_loss)
