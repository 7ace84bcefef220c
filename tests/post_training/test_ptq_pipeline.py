"""Quantization under pipeline parallelism equals one process.

On 2 gloo ranks at PP=2: each rank builds its stage of the tiny dense GPT (one transformer layer each; the
embedding on the first, the final norm and output layer on the last) holding the one-process model's weights,
and Model Optimizer quantizes it with a ``forward_loop`` that runs the calibration batch through the library's
pipeline schedule (``get_forward_backward_func``, forward only), so each stage calibrates its own layers on
the activations the previous stage sends. No amax needs agreeing between stages. The last stage's logits on
another batch equal the one-process quantized model's: a stage computes exactly what the same layers compute
in one process, so the bound is 1e-6 in fp32 (measured: 0), for FP8, INT8 SmoothQuant and INT4 AWQ.

Quantized checkpoints reshard over pipeline layouts (FP8 and INT8 SmoothQuant): a model quantized at PP=2 is
saved (``dist_checkpointing`` plus ``save_modelopt_state``) and loaded into a freshly built model with other
weights at PP=1, and a model quantized at PP=1 is loaded at PP=2; the loaded model's logits equal the saved
one's (1e-6 in fp32; the same layers on the same values; measured: 0). The saved Model Optimizer state names
every quantizer by its global layer, as a PP=1 model's state does. Virtual pipeline chunks are refused.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import dist_checkpointing, parallel_state
from tests.dist_harness import run_on_ranks
from tests.post_training.quant_test_utils import (
    LINEARS,
    batch,
    build,
    build_stage,
    config,
    logits,
    pipeline_forward,
    quantize,
    reference,
)

RECIPES = ("FP8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG", "INT4_AWQ_CFG")
BOUND = 1e-6


def _pp2_against_one_process(recipes: tuple[str, ...]) -> dict[str, float | None]:
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt.calibration import check_calibrated

    out: dict[str, float | None] = {}
    for recipe in recipes:
        weights, ref_logits = reference(recipe)
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
        try:
            stage = build_stage(weights)
            mtq.quantize(stage, getattr(mtq, recipe), lambda m: pipeline_forward(m, *batch(0)))
            check_calibrated(stage)
            assert len(stage.decoder.layers) == 1
            for name in LINEARS:
                linear = stage.decoder.layers[0].get_submodule(name)
                assert linear.weight_quantizer.amax is not None, f"{recipe}: {name} weight not calibrated"
            with torch.no_grad():
                ours = pipeline_forward(stage, *batch(7))
            out[recipe] = None if ours is None else (ours - ref_logits).abs().max().item()
        finally:
            parallel_state.destroy_model_parallel()
    return out


def test_pp2_quantized_model_equals_one_process():
    first, last = run_on_ranks(2, _pp2_against_one_process, RECIPES, timeout=500)
    assert first == dict.fromkeys(RECIPES)  # the first stage has no logits
    for recipe in RECIPES:
        assert last[recipe] < BOUND, f"{recipe}: PP=2 logits differ from one process by {last[recipe]:.3g}"


def test_reference_logits_are_those_of_the_quantized_one_process_model():
    _, ref = reference("FP8_DEFAULT_CFG")
    assert (ref - logits(build())).abs().max() > 1e-4  # the parity above compares quantized models


CKPT_RECIPES = ("FP8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG")


def _quantizer_names(state: dict) -> list[list[str]]:
    return [sorted(entry["metadata"]["quantizer_state"]) for _, entry in state["modelopt_state_dict"]]


def _canonical(value: object) -> object:
    """``value`` comparable with ``==`` whatever the order of its dicts' keys (tensors as their shape and values)."""
    if isinstance(value, dict):
        return sorted((repr(k), _canonical(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.tolist())
    return repr(value)


def _assert_same_state(saved: dict, expected: dict, recipe: str) -> None:
    """The same modes, configs and per-quantizer settings (by name; the order is free)."""
    assert [m for m, _ in saved["modelopt_state_dict"]] == [m for m, _ in expected["modelopt_state_dict"]], recipe
    for (mode, ours), (_, ref) in zip(saved["modelopt_state_dict"], expected["modelopt_state_dict"], strict=True):
        assert ours["config"] == ref["config"], f"{recipe} {mode}: configs differ"
        ours, ref = ours["metadata"]["quantizer_state"], ref["metadata"]["quantizer_state"]
        differ = {n: (ours[n], ref[n]) for n in ref if _canonical(ours[n]) != _canonical(ref[n])}
        assert not differ, f"{recipe} {mode}: {len(differ)} quantizers' settings differ, e.g. {next(iter(differ.items()))}"


def _pp_checkpoint_round_trips(recipes: tuple[str, ...], root: str) -> dict[str, object]:
    """Per recipe: |logit differences| of PP=2 -> PP=1 and PP=1 -> PP=2 reloads; then the virtual-pipeline refusal."""
    import modelopt.torch.opt as mto
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt.checkpointing import (
        _saved_state,
        load_modelopt_state,
        save_modelopt_state,
    )

    def load(model, ckpt):
        load_modelopt_state(model, ckpt)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt))
        return model

    out: dict[str, object] = {}
    other = {k: v.detach().clone() for k, v in build(seed=99).named_parameters()}  # so only the checkpoint can match
    for recipe in recipes:
        weights, ref_logits = reference(recipe)
        one = quantize(build(), recipe)
        pp2_ckpt, pp1_ckpt = f"{root}/{recipe}_pp2", f"{root}/{recipe}_pp1"
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
        try:
            stage = build_stage(weights)
            mtq.quantize(stage, getattr(mtq, recipe), lambda m: pipeline_forward(m, *batch(0)))
            with torch.no_grad():
                saved = pipeline_forward(stage, *batch(7))
            dist_checkpointing.save(stage.sharded_state_dict(), pp2_ckpt)
            save_modelopt_state(stage, pp2_ckpt)
            # layout-independent: the names (and settings) a PP=1 model of the recipe records
            assert _quantizer_names(_saved_state(pp2_ckpt)) == _quantizer_names(mto.modelopt_state(one)), recipe
            _assert_same_state(_saved_state(pp2_ckpt), mto.modelopt_state(one), recipe)
        finally:
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel()  # PP=1 (the two ranks are data-parallel replicas)
        try:
            reloaded = logits(load(build(seed=99), pp2_ckpt))
            out[f"{recipe} PP=2->1 vs reference"] = (reloaded - ref_logits).abs().max().item()
            if saved is not None:
                out[f"{recipe} PP=2->1 vs saved"] = (reloaded - saved).abs().max().item()
            dist_checkpointing.save(one.sharded_state_dict(), pp1_ckpt)
            save_modelopt_state(one, pp1_ckpt)
        finally:
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
        try:
            stage = load(build_stage(other), pp1_ckpt)
            assert len(stage.decoder.layers) == 1
            with torch.no_grad():
                ours = pipeline_forward(stage, *batch(7))
            if ours is not None:
                out[f"{recipe} PP=1->2 vs reference"] = (ours - ref_logits).abs().max().item()
        finally:
            parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    try:
        from megatron_core.models.gpt import GPTModel
        from megatron_core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from tests.post_training.quant_test_utils import MAX_SEQ, VOCAB

        cfg = config(num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                     pipeline_dtype=torch.float32)
        chunk = GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, MAX_SEQ,
                         position_embedding_type="rope", pre_process=False, post_process=False, vp_stage=1)
        with pytest.raises(NotImplementedError, match="virtual pipeline"):
            load_modelopt_state(chunk, f"{root}/{recipes[0]}_pp1")
        out["virtual pipeline refused"] = True
    finally:
        parallel_state.destroy_model_parallel()
    return out


def test_quantized_checkpoint_reshards_between_pp2_and_pp1(tmp_path):
    first, last = run_on_ranks(2, _pp_checkpoint_round_trips, CKPT_RECIPES, str(tmp_path), timeout=500)
    for rank, result in enumerate((first, last)):
        print(f"rank {rank}: {result}")
        assert result.pop("virtual pipeline refused") is True
        expected = {f"{r} PP=2->1 vs reference" for r in CKPT_RECIPES}
        if rank == 1:
            expected |= {f"{r} {case}" for r in CKPT_RECIPES for case in ("PP=2->1 vs saved", "PP=1->2 vs reference")}
        assert set(result) == expected
        for case, diff in result.items():
            assert diff < BOUND, f"rank {rank}: {case}: logits differ by {diff:.3g}"
