"""Quantization under tensor parallelism equals one process, and quantized checkpoints reshard.

On 2 gloo ranks: a tiny GPT sharded over TP=2, holding the shards of the one-process model's weights and
quantized with the same recipe and calibration batch, gives the one-process quantized model: the same
effective weights (the fake-quantized weight times the input's pre-quantization scale, the shards of the
one-process ones) and the same logits. See ``megatron_core.post_training.modelopt.quant_modules`` for what
the TP ranks agree on and ``awq_tp`` for AWQ's statistics.

Tolerances (:data:`PARITY`). A quantizer rounds to a grid, so a value within rounding noise of a grid
midpoint may land on the neighbouring point under TP, moving by a whole step (amax / 127 for INT8). In fp32
the row-parallel all-reduce sums its partial products in another order than one process (about 1e-7
relative), which did that to a few activations of INT8 SmoothQuant (1.5e-3 in the logits) and of FP8 (below
1e-5 until 2026-12-02, 2.4e-4 from 2026-12-02 on, also at the earlier code that had passed: the installed dependencies); the fp32 FP8 bound is
therefore a few activations moving one step (2e-3), and the exact check is float64's. In float64 that noise is 1e-16 and FP8, INT8 SmoothQuant and INT4 AWQ equal one
process to 1e-9 (measured 1e-15), and so do their pre-quantization scales and weight amax (measured: equal).
AWQ computes its statistics and scales in fp32 whatever the model's dtype; ``awq_tp`` makes them the
whole layer's, rounded as one process rounds them, also for the row-parallel layers (before that fix the
row layers' scales and amax were 5 % from one process's, one INT4 weight of 131072 moved a level and the
logits 4.5e-4; before the column fix the logits moved 0.11).

The model is :data:`WIDE` here: INT4 AWQ's 128-wide blocks must fit whole in every row-parallel input shard.
A model quantized at TP=2 saved through ``dist_checkpointing`` (weights, quantizer buffers, Model
Optimizer's state) loads into a fresh model at TP=1 with identical logits.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import shard
from tests.post_training.quant_test_utils import (
    LINEARS,
    WIDE,
    build,
    global_batch,
    load_sharded,
    logits,
    quantize,
    quantize_with,
    reference,
    sized_batch,
)

RECIPES = ("FP8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG", "INT4_AWQ_CFG")
# (recipe, model dtype, bound on max |logit difference| from one process, bound on the relative difference of
# a pre-quantization scale or weight amax); see the module docstring.
PARITY = [
    ("FP8_DEFAULT_CFG", torch.float32, 2e-3, 1e-5),
    ("FP8_DEFAULT_CFG", torch.float64, 1e-9, 1e-9),
    ("INT8_SMOOTHQUANT_CFG", torch.float64, 1e-9, 1e-6),
    ("INT4_AWQ_CFG", torch.float64, 1e-9, 1e-9),
]


def _tp2_model(recipe: str, weights: dict, dtype: torch.dtype = torch.float32, **overrides):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = build(dtype=dtype, tensor_model_parallel_size=2, **overrides)
    load_sharded(model, weights, 2, parallel_state.get_tensor_model_parallel_rank())
    return quantize(model, recipe)


def effective_weights(model) -> dict[str, torch.Tensor]:
    """What each quantized linear multiplies its input by: fake-quantized weight times the pre-quantization scale."""
    out = {}
    with torch.no_grad():
        for i, layer in enumerate(model.decoder.layers):
            for name in LINEARS:
                linear = layer.get_submodule(name)
                weight = linear.weight_quantizer(linear.weight)
                scale = getattr(linear.input_quantizer, "_pre_quant_scale", None)
                if scale is not None and linear.input_quantizer._enable_pre_quant_scale:
                    weight = weight * scale.reshape(1, -1)
                out[f"decoder.layers.{i}.{name}.weight"] = weight.clone()
    return out


def quantizer_values(model) -> dict[str, torch.Tensor]:
    """Each quantized linear's pre-quantization scale and weight amax, each spread to the weight's shape (so a TP
    shard of them is the shard of the one-process ones): ``<linear>.weight <scale|amax>``."""
    out = {}
    with torch.no_grad():
        for i, layer in enumerate(model.decoder.layers):
            for name in LINEARS:
                linear = layer.get_submodule(name)
                rows, cols = linear.weight.shape
                scale = linear.input_quantizer.pre_quant_scale
                scale = torch.ones(1, cols) if scale is None else scale.double().reshape(1, cols)
                amax = linear.weight_quantizer.amax.double()
                amax = amax.reshape(rows, -1) if amax.numel() > 1 else amax.reshape(1, 1)
                amax = amax.repeat_interleave(cols // amax.shape[1], dim=1).expand(rows, cols)
                out[f"decoder.layers.{i}.{name}.weight scale"] = scale.expand(rows, cols)
                out[f"decoder.layers.{i}.{name}.weight amax"] = amax
    return out


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs() / ref.abs()).max().item()


def _flips(ours: torch.Tensor, ref: torch.Tensor) -> int:
    """How many entries of ``ours`` differ from ``ref`` by more than 1e-5 of ``ref``'s largest entry."""
    far = (ours - ref).abs() > 1e-5 * ref.abs().max()
    return int(far.sum())


def _tp2_against_one_process(cases: list[tuple[str, torch.dtype]]) -> dict[str, tuple[float, int, float]]:
    """Per case: (max |logit difference|, most effective weights of one layer off by more than 1e-5, largest
    relative difference of a pre-quantization scale or weight amax)."""
    out = {}
    rank = torch.distributed.get_rank()
    for recipe, dtype in cases:
        weights, _ = reference(None, dtype, **WIDE)
        one = quantize(build(dtype=dtype, **WIDE), recipe)
        ref_logits, ref_weights, ref_values = logits(one), effective_weights(one), quantizer_values(one)
        try:
            model = _tp2_model(recipe, weights, dtype, **WIDE)
            ours, values = effective_weights(model), quantizer_values(model)
            flips = max(_flips(ours[k], shard(k, ref_weights[k], 2, rank, gated=True)) for k in ours)
            apart = max(_relative(v, shard(k.split()[0], ref_values[k], 2, rank, gated=True)) for k, v in values.items())
            out[f"{recipe} {dtype}"] = ((logits(model) - ref_logits).abs().max().item(), flips, apart)
        finally:
            parallel_state.destroy_model_parallel()
    return out


def test_tp2_quantized_model_equals_one_process():
    cases = [(recipe, dtype) for recipe, dtype, _, _ in PARITY]
    bounds = {f"{recipe} {dtype}": (bound, apart) for recipe, dtype, bound, apart in PARITY}
    for rank_result in run_on_ranks(2, _tp2_against_one_process, cases, timeout=500):
        for case, (diff, flips, apart) in rank_result.items():
            bound, max_apart = bounds[case]
            print(f"{case}: logits {diff:.3g}, scales/amax {apart:.3g} apart, {flips} effective weights off")
            assert flips == 0, f"{case}: {flips} effective weights of a layer differ from one process"
            assert apart < max_apart, f"{case}: a scale or amax is {apart:.3g} from one process's (bound {max_apart:g})"
            assert diff < bound, f"{case}: TP=2 logits differ from one process by {diff:.3g} (bound {bound:g})"


def _save_tp2_load_tp1(recipe: str, ckpt: str) -> float:
    """Max |logit difference| between the TP=2 quantized model and its checkpoint loaded at TP=1.

    float64, so that the two forwards' different reduction orders cannot move a value across a rounding
    midpoint (module docstring): the checkpoint must reproduce the quantized model exactly.
    """
    from megatron_core.post_training.modelopt.checkpointing import load_modelopt_state, save_modelopt_state

    weights, _ = reference(None, torch.float64, **WIDE)
    try:
        model = _tp2_model(recipe, weights, torch.float64, **WIDE)
        saved_logits = logits(model)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
        save_modelopt_state(model, ckpt)
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        fresh = build(seed=99, dtype=torch.float64, **WIDE)  # other weights, so only the checkpoint can make the logits match
        load_modelopt_state(fresh, ckpt)
        fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt))
        return (logits(fresh) - saved_logits).abs().max().item()
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("recipe", RECIPES)
def test_checkpoint_saved_at_tp2_loads_at_tp1(recipe, tmp_path):
    for diff in run_on_ranks(2, _save_tp2_load_tp1, recipe, str(tmp_path / "ckpt"), timeout=280):
        assert diff < 1e-9, f"{recipe}: logits after TP=2 -> TP=1 reload differ by {diff:.3g}"


def _load_errors(ckpt: str) -> list[str]:
    from megatron_core.post_training.modelopt.checkpointing import (
        check_checkpoint_recipe,
        checkpoint_recipe,
        load_modelopt_state,
        save_modelopt_state,
    )

    errors = []
    weights, _ = reference(None)
    try:
        model = _tp2_model("INT8_SMOOTHQUANT_CFG", weights)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
        save_modelopt_state(model, ckpt)
        with pytest.raises(ValueError, match="already converted"):
            load_modelopt_state(model, ckpt)
        other = quantize(build(tensor_model_parallel_size=2), "FP8_DEFAULT_CFG")  # another recipe
        both = r"quantized with INT8_SMOOTHQUANT_CFG, but this GPTModel is quantized with FP8_DEFAULT_CFG"
        with pytest.raises(ValueError, match=both):
            check_checkpoint_recipe(other, ckpt)
        with pytest.raises(ValueError, match=both):
            load_modelopt_state(other, ckpt)
        assert checkpoint_recipe(ckpt) == "INT8_SMOOTHQUANT_CFG"
        with pytest.raises(Exception, match=r"weight_quantizer\._amax"):
            other.load_state_dict(dist_checkpointing.load(other.sharded_state_dict(), ckpt))
        errors.append("recipe mismatch")
        with pytest.raises(ValueError, match="holds no modelopt_state"):
            load_modelopt_state(build(tensor_model_parallel_size=2), ckpt + "_missing")
        errors.append("no modelopt_state")
        awq = quantize(build(tensor_model_parallel_size=2), "INT4_AWQ_CFG")  # linear_proj's input shard: 64 < 128
        with pytest.raises(ValueError, match=r"linear_proj.*weight blocks \(128 input channels\) do not divide.*\(64"):
            awq.sharded_state_dict()
        errors.append("blocks straddle shards")
    finally:
        parallel_state.destroy_model_parallel()
    return errors


def test_bad_loads_raise_clear_errors(tmp_path):
    for errors in run_on_ranks(2, _load_errors, str(tmp_path / "ckpt"), timeout=280):
        assert errors == ["recipe mismatch", "no modelopt_state", "blocks straddle shards"]


def test_save_of_an_unquantized_model_is_refused(tmp_path):
    from megatron_core.post_training.modelopt.checkpointing import save_modelopt_state

    with pytest.raises(ValueError, match="no modelopt_state to save"):
        save_modelopt_state(build(), tmp_path)
    assert not torch.distributed.is_initialized()


# Data-parallel AWQ cases: (name, sequences in rank 0's and rank 1's calibration batch, references).
# "steps": one process calibrating on the two batches one after another; "global": on both as one batch.
DP_CASES = [("equal", (2, 2), ("steps", "global")), ("unequal", (1, 3), ("global",))]
# Bounds on max |logit difference| per reference. "steps" computes every AWQ statistic in the same fp32
# operations as DP=2 (the mean |x| of each batch, averaged; the per-batch errors, summed), so it is exact
# (measured 0). "global" takes the mean |x| over all sequences at once and rounds it to fp32 once, DP=2 rounds
# each rank's mean and then their (token-weighted) average: act_scale differs by about 1 fp32 ulp (6e-8),
# which moves the scales and block amax by as much (measured 3e-8 / 5e-8 in the logits, no INT4 level changed).
DP_BOUNDS = {"steps": 1e-9, "global": 1e-6}


def _dp2_awq_against_one_process() -> dict[str, tuple[float, int]]:
    """Per case and reference: (max |logit difference|, most effective weights of one layer off by 1e-5).

    Both ranks hold the same float64 weights (TP=1, DP=2); rank r calibrates INT4 AWQ on its own batch.
    """
    rank = torch.distributed.get_rank()
    out = {}
    for case, sizes, references in DP_CASES:
        batches = [sized_batch(10 + i, size) for i, size in enumerate(sizes)]
        parallel_state.initialize_model_parallel()
        try:
            model = quantize_with(build(dtype=torch.float64), "INT4_AWQ_CFG", [batches[rank]])
            ours, ours_logits = effective_weights(model), logits(model)
        finally:
            parallel_state.destroy_model_parallel()
        for ref in references:
            one = quantize_with(build(dtype=torch.float64), "INT4_AWQ_CFG",
                                batches if ref == "steps" else [global_batch(batches)])
            ref_weights = effective_weights(one)
            flips = max(_flips(ours[k], ref_weights[k]) for k in ours)
            out[f"{case} {ref}"] = ((ours_logits - logits(one)).abs().max().item(), flips)
    return out


def test_dp2_awq_equals_one_process_on_both_batches():
    """INT4 AWQ at DP=2, each rank on its own batch, equals one process on both (before the fix: see the docs)."""
    for rank_result in run_on_ranks(2, _dp2_awq_against_one_process, timeout=500):
        assert len(rank_result) == 3
        for case, (diff, flips) in rank_result.items():
            bound = DP_BOUNDS[case.split()[1]]
            assert flips == 0, f"{case}: {flips} effective weights of a layer differ from one process"
            assert diff < bound, f"{case}: DP=2 logits differ from one process by {diff:.3g} (bound {bound:g})"
