"""The ``fsdp_dtensor`` checkpoint format: FSDP2 at DP=2 saves, DP=1 and DP=4 load and continue identically.

FSDP2 (TorchFullyShardedDataParallel) trains the tiny llama-like GPT (SwiGLU) 3 steps at DP=2 and saves
with ``ckpt_format="fsdp_dtensor"``. Loaded at DP=1 and DP=4 into differently initialised models, the
weights and AdamW moments equal the saved ones bit for bit and the next step's loss and weights equal
those of the run that never saved. A corrupt or mismatched checkpoint raises naming the key and directory.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.training import get_checkpoint_name, load_checkpoint, save_checkpoint
from tests.dist_harness import run_on_ranks
from tests.distributed import fsdp_gpt as fg

TOL = 1e-6


def _full_optimizer_states(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.module.named_parameters():
        for state_name, value in opt.optimizer.state[param].items():
            out[f"{name}.{state_name}"] = (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
    return out


def _source(save_dir: str) -> dict:
    initial, _, _ = fg.reference(steps=0)
    parallel_state.initialize_model_parallel()
    try:
        model, opt, sched = fg.build_fsdp(initial, 1)
        for step in range(fg.STEPS):
            fg.train_step(model, opt, sched, step)
        save_checkpoint(save_dir, fg.STEPS, [model], opt, sched, ckpt_format="fsdp_dtensor")
        saved = (fg.full_weights(model, 1), _full_optimizer_states(model, opt))
        loss = fg.train_step(model, opt, sched, fg.STEPS)
        return {"saved": saved, "loss": loss, "after": fg.full_weights(model, 1)}
    finally:
        parallel_state.destroy_model_parallel()


def _load(load_dir: str) -> dict:
    other, _, _ = fg.reference(steps=0, init_method_std=0.05)  # weights the checkpoint must overwrite
    parallel_state.initialize_model_parallel()
    try:
        model, opt, sched = fg.build_fsdp(other, 1)
        state = load_checkpoint(load_dir, [model], opt, sched, ckpt_format="fsdp_dtensor")
        assert state["iteration"] == fg.STEPS and sched.num_steps == fg.STEPS
        loaded = (fg.full_weights(model, 1), _full_optimizer_states(model, opt))
        loss = fg.train_step(model, opt, sched, fg.STEPS)
        return {"saved": loaded, "loss": loss, "after": fg.full_weights(model, 1)}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def dp2_checkpoint(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("fsdp_dtensor") / "ckpt")
    return save_dir, run_on_ranks(2, _source, save_dir)[0]


@pytest.mark.parametrize("world", [1, 4])
def test_dp2_checkpoint_loads_and_continues_at_other_dp(dp2_checkpoint, world):
    save_dir, source = dp2_checkpoint
    got = run_on_ranks(world, _load, save_dir)[0]
    (weights, states), (want_weights, want_states) = got["saved"], source["saved"]
    assert weights.keys() == want_weights.keys() and states.keys() == want_states.keys()
    assert {k.rsplit(".", 1)[1] for k in states} == {"exp_avg", "exp_avg_sq", "step"}
    for key, value in {**weights, **states}.items():
        assert torch.equal(value, {**want_weights, **want_states}[key]), key
    assert abs(got["loss"] - source["loss"]) < TOL, (got["loss"], source["loss"])
    for name, value in got["after"].items():
        torch.testing.assert_close(value, source["after"][name], atol=TOL, rtol=0)


def test_checkpoint_layout_holds_split_swiglu_and_no_pickled_entries(dp2_checkpoint):
    from megatron_core.dist_checkpointing.safe_load import read_dcp_metadata

    save_dir, _ = dp2_checkpoint
    meta = read_dcp_metadata(get_checkpoint_name(save_dir, fg.STEPS)).state_dict_metadata
    assert "model.decoder.layers.0.mlp.linear_fc1.weight_w" in meta
    assert "model.decoder.layers.0.mlp.linear_fc1.weight" not in meta
    assert "optimizer.state.decoder.layers.0.mlp.linear_fc1.weight_v.exp_avg" in meta
    assert all(hasattr(md, "size") for md in meta.values())  # tensors only: nothing DCP would unpickle


def _load_expecting_error(load_dir: str, overrides: dict, check_architecture: bool = True) -> str:
    from megatron_core.training.fsdp_dtensor_format import load_fsdp_dtensor_checkpoint

    other, _, _ = fg.reference(steps=0, **overrides)
    parallel_state.initialize_model_parallel()
    try:
        model, opt, sched = fg.build_fsdp(other, 1, **overrides)
        try:
            if check_architecture:
                load_checkpoint(load_dir, [model], opt, sched, ckpt_format="fsdp_dtensor")
            else:  # the format's own key and shape checks, below the architecture record
                load_fsdp_dtensor_checkpoint(get_checkpoint_name(load_dir, fg.STEPS), [model], opt, sched,
                                             iteration=fg.STEPS)
        except CheckpointingException as e:
            return str(e)
        raise AssertionError("load_checkpoint accepted a mismatched checkpoint")
    finally:
        parallel_state.destroy_model_parallel()


def test_mismatched_model_raises_naming_key(dp2_checkpoint):
    save_dir, _ = dp2_checkpoint
    message = run_on_ranks(2, _load_expecting_error, save_dir, {"ffn_hidden_size": 48})[0]
    assert "ffn_hidden_size is 64 in the checkpoint and 48" in message and "iter_0000003" in message
    message = run_on_ranks(2, _load_expecting_error, save_dir, {"ffn_hidden_size": 48}, False)[0]
    assert "linear_fc1.weight_w" in message and "shapes differ" in message and "iter_0000003" in message


def test_truncated_data_file_raises_naming_file(dp2_checkpoint, tmp_path):
    import shutil

    save_dir, _ = dp2_checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(save_dir, copy)
    checkpoint_dir = get_checkpoint_name(str(copy), fg.STEPS)
    data = sorted(f for f in os.listdir(checkpoint_dir) if f.endswith(".distcp"))[0]
    with open(checkpoint_dir / data, "r+b") as f:
        f.truncate(16)
    message = run_on_ranks(2, _load_expecting_error, str(copy), {})[0]
    assert data in message


def test_default_format_loader_names_fsdp_dtensor(dp2_checkpoint):
    save_dir, _ = dp2_checkpoint
    message = run_on_ranks(2, _load_default_format, save_dir)[0]
    assert "ckpt_format='fsdp_dtensor'" in message


def _load_default_format(load_dir: str) -> str:
    initial, _, _ = fg.reference(steps=0)
    parallel_state.initialize_model_parallel()
    try:
        model, opt, sched = fg.build_fsdp(initial, 1)
        with pytest.raises(CheckpointingException) as err:
            load_checkpoint(load_dir, [model], opt, sched)
        return str(err.value)
    finally:
        parallel_state.destroy_model_parallel()


def test_unknown_format_raises():
    with pytest.raises(ValueError, match="ckpt_format .'torch'. must be one of"):
        save_checkpoint("/nonexistent", 1, torch.nn.Linear(2, 2), None, None, ckpt_format="torch")


def _load_adapter(load_dir: str, strategy: str) -> dict:
    from tests.distributed import megatron_fsdp_gpt as mg

    other, _, _ = fg.reference(steps=0, init_method_std=0.05)
    parallel_state.initialize_model_parallel()
    try:
        model, opt, sched = mg.build_adapter(other, 1, strategy)
        try:
            load_checkpoint(load_dir, [model], opt, sched, ckpt_format="fsdp_dtensor")
        except ValueError as e:
            return {"error": str(e)}
        return {"loss": fg.train_step(model, opt, sched, fg.STEPS), "after": mg.full_weights(model, 1)}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_megatron_fsdp_adapter_loads_and_continues(dp2_checkpoint, strategy):
    save_dir, source = dp2_checkpoint
    got = run_on_ranks(4, _load_adapter, save_dir, strategy)[0]
    assert abs(got["loss"] - source["loss"]) < TOL, (got["loss"], source["loss"])
    for name, value in got["after"].items():
        torch.testing.assert_close(value, source["after"][name], atol=TOL, rtol=0)


def test_distributed_optimizer_is_refused(dp2_checkpoint):
    save_dir, _ = dp2_checkpoint
    message = run_on_ranks(2, _load_adapter, save_dir, "optim")[0]["error"]
    assert "use_distributed_optimizer=True" in message and "torch_dist" in message


def _validate_after_save(save_dir: str) -> None:
    from megatron_core.training.fsdp_dtensor_state import fsdp_dtensor_state_dict
    from megatron_core.transformer.fsdp_dtensor_checkpoint import validate_loaded_state_dict

    initial, _, _ = fg.reference(steps=0)
    parallel_state.initialize_model_parallel()
    try:
        model, opt, sched = fg.build_fsdp(initial, 1)
        fg.train_step(model, opt, sched, 0)
        save_checkpoint(save_dir, 1, [model], opt, sched, ckpt_format="fsdp_dtensor")
        flat = fsdp_dtensor_state_dict(model, opt)
        validate_loaded_state_dict(flat, str(get_checkpoint_name(save_dir, 1)))
        with torch.no_grad():
            model.module.decoder.layers[0].mlp.linear_fc1.weight._local_tensor.add_(1.0)
        with pytest.raises(CheckpointingException, match=r"linear_fc1\.weight_[wv]"):
            validate_loaded_state_dict(flat, str(get_checkpoint_name(save_dir, 1)))
    finally:
        parallel_state.destroy_model_parallel()


def test_validate_loaded_state_dict_on_dtensors_and_sections(tmp_path):
    run_on_ranks(4, _validate_after_save, str(tmp_path / "ckpt"))


def _save_again(save_dir: str, overwrite: bool) -> str:
    initial, _, _ = fg.reference(steps=0)
    parallel_state.initialize_model_parallel()
    try:
        model, opt, sched = fg.build_fsdp(initial, 1)
        try:
            save_checkpoint(save_dir, fg.STEPS, [model], opt, sched, ckpt_format="fsdp_dtensor", overwrite=overwrite)
        except CheckpointingException as e:
            return str(e)
        return "saved"
    finally:
        parallel_state.destroy_model_parallel()


def test_saving_over_a_complete_checkpoint_needs_overwrite(dp2_checkpoint, tmp_path):
    import shutil

    save_dir, _ = dp2_checkpoint
    copy = str(tmp_path / "copy")
    shutil.copytree(save_dir, copy)
    assert "already holds a complete checkpoint" in run_on_ranks(2, _save_again, copy, False)[0]
    assert run_on_ranks(2, _save_again, copy, True)[0] == "saved"
    assert sorted(os.listdir(copy)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
