"""``save_checkpoint``/``load_checkpoint`` on a tiny GPT with the Megatron optimizer and scheduler.

Round trip in one process (model, Adam states, scheduler, iteration; the tracker, explicit
iterations, ``load_optimizer=False`` and the overwrite guard).

Bit-exact resume: one run trains 5 steps, saves (once synchronously, once asynchronously: the async save
finishes while training goes on), trains 5 more (the straight 10 steps); for each checkpoint a second
call (parallel_state rebuilt, model built from another seed, every RNG reseeded) loads the
checkpoint and trains steps 6-10: losses and final weights must be bitwise equal. Dropout is on, so
the RNG states (torch and the tensor-parallel tracker) have to be restored too.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from megatron_core import parallel_state
from megatron_core.dist_checkpointing import AsyncCallsQueue, CheckpointingException
from megatron_core.training import (
    get_checkpoint_name,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
)
from tests.dist_checkpointing.gpt_training import build, train_step, weights
from tests.dist_harness import run_on_ranks

WORLD = 4
LAYOUTS = {"tp2_pp2": dict(tp=2, pp=2), "dp2_tp2_distopt": dict(tp=2, pp=1, distributed_optimizer=True)}


def _straight(sync_dir: str, async_dir: str, layout: dict) -> dict:
    """Ten steps, saving step 5 twice: synchronously to ``sync_dir``, then asynchronously (finished while steps
    6-10 run) to ``async_dir``; both checkpoints must resume to this run's steps 6-10."""
    chunks, opt, sched = build(**layout, dropout=0.1)
    queue = AsyncCallsQueue()
    losses = []
    for step in range(1, 11):
        losses += train_step(chunks, opt, sched, step)
        if step == 5:
            for save_dir, async_queue in ((sync_dir, None), (async_dir, queue)):
                save_checkpoint(save_dir, step, chunks, opt, sched, consumed_train_samples=40,
                                extra_state={"args": {"seed": 1234}}, async_queue=async_queue)
    assert read_tracker(async_dir) is None and queue.get_num_unfinalized_calls() == 1  # not finalized yet
    queue.close()
    assert read_tracker(async_dir) == 5
    return {"losses": losses[len(losses) // 2:], "weights": weights(chunks)}


def _resumed(save_dir: str, layout: dict) -> dict:
    chunks, opt, sched = build(**layout, dropout=0.1, seed=777)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    state = load_checkpoint(save_dir, chunks, opt, sched)
    assert state["iteration"] == 5 and state["consumed_train_samples"] == 40, state
    assert state["extra_state"] == {"args": {"seed": 1234}}
    losses = []
    for step in range(6, 11):
        losses += train_step(chunks, opt, sched, step)
    return {"losses": losses, "weights": weights(chunks)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bit_exact_resume(tmp_path, layout):
    """Both the synchronous and the asynchronous checkpoint of one straight run resume bit-exactly."""
    dirs = {"sync": str(tmp_path / "ckpt"), "async": str(tmp_path / "ckpt_async")}
    straight = run_on_ranks(WORLD, _straight, dirs["sync"], dirs["async"], LAYOUTS[layout])
    assert any(r["losses"] for r in straight)
    for mode, save_dir in dirs.items():
        assert read_tracker(save_dir) == 5
        assert get_checkpoint_name(save_dir, 5).is_dir()
        resumed = run_on_ranks(WORLD, _resumed, save_dir, LAYOUTS[layout])
        for rank, (a, b) in enumerate(zip(straight, resumed)):
            assert len(a["losses"]) == len(b["losses"])
            for x, y in zip(a["losses"], b["losses"]):
                assert torch.equal(x, y), f"{mode}, rank {rank}: loss {x.item()} != {y.item()}"
            assert a["weights"].keys() == b["weights"].keys()
            for k in a["weights"]:
                assert torch.equal(a["weights"][k], b["weights"][k]), f"{mode}, rank {rank}: {k} differs"
        metadata = json.loads((get_checkpoint_name(save_dir, 5) / "metadata.json").read_text())
        assert metadata["sharded_backend"] == "torch_dist"


def _adam_states(opt) -> list[torch.Tensor]:
    return [state[name].clone() for group in opt.optimizer.param_groups for p in group["params"]
            for state in [opt.optimizer.state.get(p, {})] for name in ("exp_avg", "exp_avg_sq") if name in state]


def _round_trip(save_dir: str) -> bool:
    chunks, opt, sched = build(1, 1)
    assert load_checkpoint(save_dir, chunks, opt, sched, missing_ok=True) is None  # no tracker yet: load if present
    with pytest.raises(CheckpointingException, match="does not exist"):  # by default a missing checkpoint raises
        load_checkpoint(save_dir, chunks, opt, sched)
    for step in (1, 2):
        train_step(chunks, opt, sched, step)
    save_checkpoint(save_dir, 2, chunks, opt, sched, consumed_train_samples=8, extra_state=[1, "a"])
    try:
        save_checkpoint(save_dir, 2, chunks, opt, sched)
    except CheckpointingException as e:
        assert "overwrite=True" in str(e)
    else:
        raise AssertionError("saving over a complete checkpoint was not refused")
    expected_weights, expected_adam, expected_steps = weights(chunks), _adam_states(opt), sched.num_steps
    assert len(expected_adam) == 2 * len(expected_weights)

    parallel_state.destroy_model_parallel()
    chunks, opt, sched = build(1, 1, seed=5)
    state = load_checkpoint(save_dir, chunks, opt, sched, load_optimizer=False)
    assert state == {"iteration": 2, "consumed_train_samples": 8, "extra_state": [1, "a"]}, state
    assert all(torch.equal(weights(chunks)[k], v) for k, v in expected_weights.items())
    assert _adam_states(opt) == [] and sched.num_steps == 0

    parallel_state.destroy_model_parallel()
    chunks, opt, sched = build(1, 1, seed=6)
    assert load_checkpoint(save_dir, chunks, opt, sched, iteration=2)["iteration"] == 2
    assert all(torch.equal(weights(chunks)[k], v) for k, v in expected_weights.items())
    assert all(torch.equal(a, b) for a, b in zip(_adam_states(opt), expected_adam, strict=True))
    assert sched.num_steps == expected_steps
    try:
        load_checkpoint(save_dir, chunks, opt, sched, iteration=3)
    except CheckpointingException as e:
        assert "iter_0000003" in str(e)
    else:
        raise AssertionError("a missing iteration loaded")
    return True


def test_round_trip_single_process(tmp_path):
    assert run_on_ranks(1, _round_trip, str(tmp_path / "ckpt")) == [True]


def _fine_tune_start(save_dir: str, distributed_optimizer: bool) -> bool:
    """A bf16 model loaded without its optimizer state trains from the loaded weights, not from the fp32
    main params its optimizer was built with: one step equals one step of the saved model itself."""
    chunks, opt, sched = build(1, 1, bf16=True, distributed_optimizer=distributed_optimizer)
    save_checkpoint(save_dir, 1, chunks, opt, sched)
    train_step(chunks, opt, sched, 1)
    expected = weights(chunks)
    parallel_state.destroy_model_parallel()
    chunks, opt, sched = build(1, 1, bf16=True, distributed_optimizer=distributed_optimizer, seed=5)
    load_checkpoint(save_dir, chunks, opt, sched, load_optimizer=False, load_rng=False)
    train_step(chunks, opt, sched, 1)
    got = weights(chunks)
    for k, v in expected.items():
        assert torch.equal(got[k], v), f"{k}: max diff {(got[k].float() - v.float()).abs().max().item():.3e}"
    parallel_state.destroy_model_parallel()
    return True


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_load_without_optimizer_refreshes_main_params(tmp_path, distributed_optimizer):
    assert run_on_ranks(1, _fine_tune_start, str(tmp_path / "ckpt"), distributed_optimizer) == [True]


def _resume_before_first_step(save_dir: str, distributed_optimizer: bool) -> bool:
    """A checkpoint saved before the optimizer's first step (no Adam moments yet, as after upcycling) resumes
    into a fresh optimizer state: the next step equals the saved run's own."""
    chunks, opt, sched = build(1, 1, distributed_optimizer=distributed_optimizer)
    save_checkpoint(save_dir, 1, chunks, opt, sched)
    train_step(chunks, opt, sched, 1)
    expected = weights(chunks)
    parallel_state.destroy_model_parallel()
    chunks, opt, sched = build(1, 1, distributed_optimizer=distributed_optimizer, seed=5)
    load_checkpoint(save_dir, chunks, opt, sched)
    train_step(chunks, opt, sched, 1)
    got = weights(chunks)
    for k, v in expected.items():
        assert torch.equal(got[k], v), f"{k}: max diff {(got[k] - v).abs().max().item():.3e}"
    parallel_state.destroy_model_parallel()
    return True


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_checkpoint_saved_before_the_first_step_resumes(tmp_path, distributed_optimizer):
    assert run_on_ranks(1, _resume_before_first_step, str(tmp_path / "ckpt"), distributed_optimizer) == [True]
