"""Quantization of a MoE GPT under expert parallelism equals one process, and its checkpoint reshards over EP.

On 2 gloo ranks at EP=2 (and so data-parallel 2 for the dense layers): the Mixtral-shaped MoE GPT holding the
one-process model's weights (each rank its two local experts), each rank calibrating on its own batch, gives
the logits of the one-process model calibrated on both batches, for grouped (all-to-all dispatcher) and
sequential (all-gather dispatcher) experts, FP8, INT8 SmoothQuant and INT4 AWQ. That needs the input amax of
every expert the maximum over all tokens of all ranks (Model Optimizer's sync over the EP group, after the local
experts' sync for ``SequentialMLP``), each expert's weight amax its own, the dense layers' amax synced over data
parallelism, and AWQ's activation means and per-``alpha`` errors of the dense layers the token-weighted means over
data parallelism (``awq_tp``). float64, so that the ranks' different summation orders cannot move a value across
a rounding midpoint (see ``test_ptq_parallel``): the bound is 1e-9. AWQ's reference calibrates on both batches as
one batch (at EP=2 an expert sees both ranks' tokens in one call, and AWQ's statistics are per-call means); its
activation means are fp32, and the average of the ranks' rounded means differs from the rounded global mean by
about one ulp, so its bound is 1e-6 (measured 4e-8 to 5e-8; before the DP fix 0.07-0.11).

A model quantized at EP=2 and saved through ``dist_checkpointing`` (weights, every expert's quantizer buffers
under its global expert index, Model Optimizer's state re-keyed for the new expert layout) loads into a
fresh model at EP=1 with the same logits.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from tests.dist_harness import run_on_ranks
from tests.post_training.quant_test_utils import build_moe, moe_logits, quantize_on, quantize_on_global
from tests.transformer.moe.moe_parallel_utils import global_tensors, load_globals

CASES = [(grouped, recipe) for grouped in (True, False) for recipe in ("FP8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG")]
AWQ_CASES = [(grouped, "INT4_AWQ_CFG") for grouped in (True, False)]
BOUND = 1e-9
AWQ_BOUND = 1e-6  # AWQ's act_scale is fp32: the DP ranks' means averaged differ from the global mean by 1 ulp


def _ep2_model(grouped: bool, recipe: str, weights: dict) -> torch.nn.Module:
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    dispatcher = "alltoall" if grouped else "allgather"
    model = build_moe(grouped, seed=99, dtype=torch.float64, expert_model_parallel_size=2,
                      moe_token_dispatcher_type=dispatcher)
    load_globals(model, weights)
    return quantize_on(model, recipe, [torch.distributed.get_rank()])


def _reference(grouped: bool, recipe: str) -> tuple[dict, torch.nn.Module]:
    """One process on both batches: one after another (amax: a maximum), as one batch for AWQ (means, below)."""
    model = build_moe(grouped, dtype=torch.float64)
    weights = global_tensors(model)
    if recipe == "INT4_AWQ_CFG":
        return weights, quantize_on_global(model, recipe, [0, 1])
    return weights, quantize_on(model, recipe, [0, 1])


def _ep2_against_one_process(cases: list) -> dict[str, float]:
    out = {}
    rank = torch.distributed.get_rank()
    for grouped, recipe in cases:
        weights, one = _reference(grouped, recipe)
        try:
            model = _ep2_model(grouped, recipe, weights)
            out[f"grouped={grouped} {recipe}"] = (moe_logits(model, 2 + rank) - moe_logits(one, 2 + rank)).abs().max().item()
        finally:
            parallel_state.destroy_model_parallel()
    return out


def test_ep2_quantized_moe_equals_one_process():
    for rank_result in run_on_ranks(2, _ep2_against_one_process, CASES + AWQ_CASES, timeout=500):
        assert len(rank_result) == len(CASES + AWQ_CASES)
        for case, diff in rank_result.items():
            bound = AWQ_BOUND if "AWQ" in case else BOUND
            assert diff < bound, f"{case}: EP=2 logits differ from one process by {diff:.3g} (bound {bound:g})"


def _save_ep2_load_ep1(cases: list, root: str) -> dict[str, float]:
    from megatron_core.post_training.modelopt.checkpointing import load_modelopt_state, save_modelopt_state

    out = {}
    rank = torch.distributed.get_rank()
    for grouped, recipe in cases:
        ckpt = f"{root}/{'grouped' if grouped else 'sequential'}_{recipe}"
        weights, _ = _reference(grouped, recipe)
        try:
            model = _ep2_model(grouped, recipe, weights)
            saved_logits = moe_logits(model, 2 + rank)
            dist_checkpointing.save(model.sharded_state_dict(), ckpt)
            save_modelopt_state(model, ckpt)
        finally:
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel()
        try:
            fresh = build_moe(grouped, seed=7, dtype=torch.float64)  # other weights: only the checkpoint can match
            load_modelopt_state(fresh, ckpt)
            fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt))
            out[f"grouped={grouped} {recipe}"] = (moe_logits(fresh, 2 + rank) - saved_logits).abs().max().item()
        finally:
            parallel_state.destroy_model_parallel()
    return out


def test_moe_checkpoint_saved_at_ep2_loads_at_ep1(tmp_path):
    for rank_result in run_on_ranks(2, _save_ep2_load_ep1, CASES, str(tmp_path), timeout=500):
        assert len(rank_result) == len(CASES)
        for case, diff in rank_result.items():
            assert diff < BOUND, f"{case}: logits after EP=2 -> EP=1 reload differ by {diff:.3g}"


def test_grouped_experts_under_expert_tensor_parallelism_are_refused():
    for message in run_on_ranks(2, _etp2_error, timeout=300):
        assert "expert tensor parallelism (size 2) is not supported" in message


def _etp2_error() -> str:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, expert_tensor_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build_moe(True, tensor_model_parallel_size=2, expert_tensor_parallel_size=2, sequence_parallel=True)
        with pytest.raises(NotImplementedError) as err:
            quantize_on(model, "FP8_DEFAULT_CFG", [0])
        return str(err.value)
    finally:
        parallel_state.destroy_model_parallel()
