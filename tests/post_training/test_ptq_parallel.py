"""Quantization under tensor parallelism equals one process, and quantized checkpoints reshard.

On 2 gloo ranks: a tiny GPT sharded over TP=2, holding the
shards of the one-process model's weights and quantized with the same recipe and calibration batch,
gives the one-process quantized logits (fp32, 1e-5; FP8 so far, see RECIPES): the amax agreed over the TP group where the
shards share one scale (see ``megatron_core.post_training.modelopt.quant_modules``). A model
quantized at TP=2 saved through ``dist_checkpointing`` (weights, quantizer buffers, Model Optimizer's
state) loads into a fresh model at TP=1 with identical logits.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from tests.dist_harness import run_on_ranks
from tests.post_training.quant_test_utils import build, load_sharded, logits, quantize, reference

# INT8 SmoothQuant and INT4 AWQ are left out until their TP=2 results are understood: TP=2 differs from one
# process by 1.5e-3 (SmoothQuant) and 0.11 (AWQ) in the logits, a SmoothQuant TP=2 checkpoint reloads at TP=1
# 9e-3 away, and an AWQ one does not load at TP=1 (issue 42).
RECIPES = ("FP8_DEFAULT_CFG",)


def _tp2_model(recipe: str, weights: dict, **overrides):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = build(tensor_model_parallel_size=2, **overrides)
    load_sharded(model, weights, 2, parallel_state.get_tensor_model_parallel_rank())
    return quantize(model, recipe)


def _tp2_against_one_process(cases: list[tuple[str, dict]]) -> dict[str, float]:
    """Max |logit difference| between TP=2 and one process, per case."""
    out = {}
    for recipe, overrides in cases:
        weights, ref = reference(recipe)
        try:
            model = _tp2_model(recipe, weights, **overrides)
            out[f"{recipe} {overrides}"] = (logits(model) - ref).abs().max().item()
        finally:
            parallel_state.destroy_model_parallel()
    return out


@pytest.mark.parametrize("recipe, overrides", [(recipe, {}) for recipe in RECIPES])
def test_tp2_quantized_logits_equal_one_process(recipe, overrides):
    for rank_result in run_on_ranks(2, _tp2_against_one_process, [(recipe, overrides)], timeout=280):
        for case, diff in rank_result.items():
            assert diff < 1e-5, f"{case}: TP=2 differs from one process by {diff:.3g}"


def _save_tp2_load_tp1(recipe: str, ckpt: str) -> float:
    """Max |logit difference| between the TP=2 quantized model and its checkpoint loaded at TP=1."""
    from megatron_core.post_training.modelopt.checkpointing import load_modelopt_state, save_modelopt_state

    weights, _ = reference(None)
    try:
        model = _tp2_model(recipe, weights)
        saved_logits = logits(model)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
        save_modelopt_state(model, ckpt)
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        fresh = build(seed=99)  # other weights, so only the checkpoint can make the logits match
        load_modelopt_state(fresh, ckpt)
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt))
        return (logits(fresh) - saved_logits).abs().max().item()
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpoint_saved_at_tp2_loads_at_tp1(recipe, tmp_path):
    for diff in run_on_ranks(2, _save_tp2_load_tp1, recipe, str(tmp_path / "ckpt"), timeout=280):
        assert diff < 1e-5, f"{recipe}: logits after TP=2 -> TP=1 reload differ by {diff:.3g}"


def _load_errors(ckpt: str) -> list[str]:
    from megatron_core.post_training.modelopt.checkpointing import load_modelopt_state, save_modelopt_state

    errors = []
    weights, _ = reference(None)
    try:
        model = _tp2_model("INT8_SMOOTHQUANT_CFG", weights)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
        save_modelopt_state(model, ckpt)
        with pytest.raises(ValueError, match="already converted"):
            load_modelopt_state(model, ckpt)
        other = quantize(build(tensor_model_parallel_size=2), "FP8_DEFAULT_CFG")  # another recipe
        with pytest.raises(Exception, match=r"weight_quantizer\._amax"):
            other.load_state_dict(dist_checkpointing.load(other.sharded_state_dict(), ckpt))
        errors.append("recipe mismatch")
        with pytest.raises(ValueError, match="holds no modelopt_state"):
            load_modelopt_state(build(tensor_model_parallel_size=2), ckpt + "_missing")
        errors.append("no modelopt_state")
    finally:
        parallel_state.destroy_model_parallel()
    return errors


def test_bad_loads_raise_clear_errors(tmp_path):
    for errors in run_on_ranks(2, _load_errors, str(tmp_path / "ckpt"), timeout=280):
        assert errors == ["recipe mismatch", "no modelopt_state"]


def test_save_of_an_unquantized_model_is_refused(tmp_path):
    from megatron_core.post_training.modelopt.checkpointing import save_modelopt_state

    with pytest.raises(ValueError, match="no modelopt_state to save"):
        save_modelopt_state(build(), tmp_path)
    assert not torch.distributed.is_initialized()
