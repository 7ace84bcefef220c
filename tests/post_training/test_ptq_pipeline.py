"""Quantization under pipeline parallelism equals one process.

On 2 gloo ranks at PP=2: each rank builds its stage of the tiny dense GPT (one transformer layer each; the
embedding on the first, the final norm and output layer on the last) holding the one-process model's weights,
and Model Optimizer quantizes it with a ``forward_loop`` that runs the calibration batch through the library's
pipeline schedule (``get_forward_backward_func``, forward only), so each stage calibrates its own layers on
the activations the previous stage sends. No amax needs agreeing between stages. The last stage's logits on
another batch equal the one-process quantized model's: a stage computes exactly what the same layers compute
in one process, so the bound is 1e-6 in fp32 (measured: 0), for FP8, INT8 SmoothQuant and INT4 AWQ.
"""

from __future__ import annotations

import torch

from megatron_core import parallel_state
from tests.dist_harness import run_on_ranks
from tests.post_training.quant_test_utils import (
    LINEARS,
    batch,
    build,
    build_stage,
    logits,
    pipeline_forward,
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
