"""Checkpoints through Megatron-FSDP's ``FullyShardedDataParallel`` move between sharding strategies, exactly.

``optim_grads_params`` (ZeRO-3, FSDP2) at DP=2 trains 3 steps and saves with ``save_checkpoint`` (model, AdamW
moments, scheduler). Each strategy loads it into a model built from other weights: the weights equal the
source's bit for bit and the next training step has the loss the source run had at that step. The
``state_dict`` / ``load_state_dict`` pair carries the weights under the model's own keys.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.training import load_checkpoint, save_checkpoint
from tests.dist_harness import run_on_ranks
from tests.distributed import fsdp_gpt as fg
from tests.distributed import megatron_fsdp_gpt as mg

WORLD = 2


def _source(save_dir: str) -> tuple[dict, float]:
    initial, _, _ = fg.reference(steps=0)
    parallel_state.initialize_model_parallel()
    try:
        model, opt, sched = mg.build_adapter(initial, 1, "optim_grads_params")
        for step in range(fg.STEPS):
            fg.train_step(model, opt, sched, step)
        save_checkpoint(save_dir, fg.STEPS, [model], opt, sched)
        return mg.full_weights(model, 1), fg.train_step(model, opt, sched, fg.STEPS)
    finally:
        parallel_state.destroy_model_parallel()


def _load(strategy: str, load_dir: str) -> tuple[dict, float]:
    other, _, _ = fg.reference(steps=0, init_method_std=0.05)  # weights the checkpoint must overwrite
    parallel_state.initialize_model_parallel()
    try:
        model, opt, sched = mg.build_adapter(other, 1, strategy)
        state = load_checkpoint(load_dir, [model], opt, sched)
        assert state["iteration"] == fg.STEPS and sched.num_steps == fg.STEPS
        return mg.full_weights(model, 1), fg.train_step(model, opt, sched, fg.STEPS)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def source_checkpoint(tmp_path_factory) -> tuple[str, dict, float]:
    save_dir = str(tmp_path_factory.mktemp("megatron_fsdp") / "zero3")
    weights, next_loss = run_on_ranks(WORLD, _source, save_dir)[0]
    return save_dir, weights, next_loss


@pytest.mark.parametrize("strategy", mg.STRATEGIES)
def test_megatron_fsdp_checkpoint_loads_under_every_strategy(source_checkpoint, strategy: str):
    save_dir, weights, next_loss = source_checkpoint
    for got, loss in run_on_ranks(WORLD, _load, strategy, save_dir):
        assert got.keys() == weights.keys()
        for name, value in got.items():
            assert torch.equal(value, weights[name]), name
        assert abs(loss - next_loss) < 1e-5, (loss, next_loss)


def _state_dict_round_trip(strategy: str) -> list[str]:
    initial, _, _ = fg.reference(steps=0)
    other, _, _ = fg.reference(steps=0, init_method_std=0.05)
    parallel_state.initialize_model_parallel()
    try:
        source, _, _ = mg.build_adapter(initial, 1, strategy)
        target, _, _ = mg.build_adapter(other, 1, strategy)
        state = source.state_dict()
        assert source.state_dict_for_save_checkpoint().keys() == state.keys()
        target.load_state_dict(state)
        got = mg.full_weights(target, 1)
        for name, value in got.items():
            assert torch.equal(value, initial[name]), name
        return sorted(state)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_megatron_fsdp_state_dict_uses_the_models_keys(strategy: str):
    keys = run_on_ranks(WORLD, _state_dict_round_trip, strategy)[0]
    parameter_names = set(fg.reference(steps=0)[0])
    assert parameter_names <= set(keys)
    assert not any(k.startswith("module.") for k in keys)
