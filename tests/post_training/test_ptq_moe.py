"""Post-training quantization of a Mixtral-shaped MoE GPT (sequential and grouped experts), one process, CPU.

* Every linear of every transformer layer (attention, and each expert's fc1/fc2) holds calibrated quantizers;
  the router stays unquantized; ``check_calibrated`` passes; the logits change and stay within the relative
  error bound of ``test_ptq.TOLERANCE`` (the dense GPT's bounds, set from each recipe's precision: Model
  Optimizer's own tests have no bound of quantized against unquantized logits for these recipes; its Megatron
  MoE test compares grouped with sequential experts, next).
* Grouped experts quantize exactly like sequential experts holding the same weights (per-expert weight amax,
  one input amax over the layer's experts): logits within atol = rtol = 1e-6, the tolerance of Model
  Optimizer's ``test_te_grouped_vs_sequential_quantize`` (tests/gpu_megatron/torch/quantization/plugins/
  test_megatron.py), for the recipes without smoothing (SmoothQuant/AWQ do not act on grouped experts).
* An expert that gets no calibration token is calibrated the way Model Optimizer does it: its weight amax from
  its weight, its input amax the maximum of the layer's other local experts. With no calibration batch at
  all, ``check_calibrated`` names the experts' input quantizers (their weights calibrate from themselves).
"""

from __future__ import annotations

import pytest
import torch

from tests.post_training.quant_test_utils import build_moe, moe_batch, moe_logits, quantize_on
from tests.post_training.test_ptq import TOLERANCE
from tests.transformer.moe.moe_parallel_utils import sequential_to_grouped_state

ATTENTION = ("self_attention.linear_qkv", "self_attention.linear_proj")


def _expert_linears(layer: torch.nn.Module) -> list[torch.nn.Module]:
    experts = layer.mlp.experts
    if hasattr(experts, "local_experts"):
        return [getattr(e, fc) for e in experts.local_experts for fc in ("linear_fc1", "linear_fc2")]
    return [experts.linear_fc1, experts.linear_fc2]


def _weight_quantizers(linear: torch.nn.Module) -> list[torch.nn.Module]:
    quantizer = linear.weight_quantizer
    return list(quantizer) if isinstance(quantizer, torch.nn.ModuleList) else [quantizer]


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
@pytest.mark.parametrize("recipe", sorted(TOLERANCE))
def test_every_linear_of_every_layer_is_calibrated_and_logits_stay_close(recipe, grouped):
    from megatron_core.post_training.modelopt.calibration import check_calibrated

    model = build_moe(grouped)
    ref = moe_logits(model, 9)
    quantize_on(model, recipe, [0, 1])
    check_calibrated(model)
    for i, layer in enumerate(model.decoder.layers):
        linears = [layer.get_submodule(n) for n in ATTENTION] + _expert_linears(layer)
        assert len(linears) == 2 + (2 if grouped else 8)
        for linear in linears:
            assert type(linear).__name__.startswith("Quant"), f"layer {i}: {type(linear).__name__} not converted"
            quantizers = _weight_quantizers(linear)
            assert len(quantizers) == (4 if grouped and linear not in linears[:2] else 1)
            for q in quantizers:
                assert q.is_enabled and q.amax is not None, f"layer {i} {type(linear).__name__}: weight amax"
            if linear.input_quantizer.is_enabled:
                assert linear.input_quantizer.amax is not None
        assert not hasattr(layer.mlp.router, "weight_quantizer")
        assert not any("quantizer" in n for n, _ in layer.mlp.router.named_modules())
    error = ((moe_logits(model, 9) - ref).norm() / ref.norm()).item()
    assert 1e-4 < error < TOLERANCE[recipe], f"{recipe} grouped={grouped}: relative logit error {error:.4g}"


@pytest.mark.parametrize("recipe", ["FP8_DEFAULT_CFG", "INT8_DEFAULT_CFG"])  # NVFP4 fake quant needs CUDA
def test_grouped_experts_quantize_like_sequential_experts(recipe):
    sequential = build_moe(grouped=False)
    grouped = build_moe(grouped=True, seed=5)
    grouped.load_state_dict(sequential_to_grouped_state(sequential.state_dict()), strict=False)
    torch.testing.assert_close(moe_logits(grouped, 9), moe_logits(sequential, 9), atol=1e-6, rtol=1e-6)
    for model in (sequential, grouped):
        quantize_on(model, recipe, [0, 1])
    torch.testing.assert_close(moe_logits(grouped, 9), moe_logits(sequential, 9), atol=1e-6, rtol=1e-6)
    for seq_layer, grp_layer in zip(sequential.decoder.layers, grouped.decoder.layers):
        for fc in ("linear_fc1", "linear_fc2"):
            grouped_fc = getattr(grp_layer.mlp.experts, fc)
            for e, expert in enumerate(seq_layer.mlp.experts.local_experts):
                seq_fc = getattr(expert, fc)
                torch.testing.assert_close(grouped_fc.weight_quantizer[e].amax, seq_fc.weight_quantizer.amax)
                torch.testing.assert_close(grouped_fc.input_quantizer.amax, seq_fc.input_quantizer.amax)


def _tokens_per_expert(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> list[list[int]]:
    """Tokens each layer's experts receive for ``(ids, pos)`` (unquantized forward)."""
    counts: list[list[int]] = []

    def hook(_module, args):
        counts.append([int(c) for c in args[1]])

    handles = [layer.mlp.experts.register_forward_pre_hook(hook) for layer in model.decoder.layers]
    with torch.no_grad():
        model(ids, pos, None)
    for handle in handles:
        handle.remove()
    return counts


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_an_expert_without_calibration_tokens_is_still_calibrated(grouped):
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt.calibration import check_calibrated

    model = build_moe(grouped)
    ids, pos = (t[:1, :1] for t in moe_batch(0))  # one token: top-2 of 4 experts leaves two idle in every layer
    counts = _tokens_per_expert(model, ids, pos)
    assert all(sorted(c) == [0, 0, 1, 1] for c in counts), counts
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: m(ids, pos, None))
    check_calibrated(model)
    for layer, layer_counts in zip(model.decoder.layers, counts):
        experts = layer.mlp.experts
        for fc in ("linear_fc1", "linear_fc2"):
            if grouped:
                linear = getattr(experts, fc)
                weights = [(linear.weight[e], linear.weight_quantizer[e]) for e in range(4)]
                assert linear.input_quantizer.amax is not None
            else:
                linears = [getattr(e, fc) for e in experts.local_experts]
                weights = [(lin.weight, lin.weight_quantizer) for lin in linears]
                busy = [lin.input_quantizer.amax for lin, c in zip(linears, layer_counts) if c > 0]
                for lin in linears:  # one input amax for all local experts: the busy experts' maximum
                    torch.testing.assert_close(lin.input_quantizer.amax, torch.stack(busy).amax())
            for weight, quantizer in weights:
                torch.testing.assert_close(quantizer.amax, weight.detach().abs().amax())


@pytest.mark.parametrize(("grouped", "first_expert_input"), [
    (False, r"decoder\.layers\.0\.mlp\.experts\.local_experts\.0\.linear_fc1\.input_quantizer"),
    (True, r"decoder\.layers\.0\.mlp\.experts\.linear_fc1\.input_quantizer"),
], ids=["sequential", "grouped"])
def test_check_calibrated_names_expert_quantizers_when_no_batch_ran(grouped, first_expert_input):
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt.calibration import check_calibrated, uncalibrated_quantizers

    model = build_moe(grouped)
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: None)
    missing = uncalibrated_quantizers(model)
    assert not [n for n in missing if "weight_quantizer" in n]  # weights calibrate from themselves
    assert sum("experts" in n for n in missing) == (16 if not grouped else 4)  # every expert input quantizer
    with pytest.raises(ValueError, match=first_expert_input):
        check_calibrated(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="NVFP4 fake quantization runs with CUDA kernels only")
def test_nvfp4_of_grouped_and_sequential_experts_on_cuda():
    """NVFP4 (Model Optimizer 0.47 has no CPU path): every expert calibrated, grouped equals sequential (1e-6)."""
    from megatron_core.post_training.modelopt.calibration import check_calibrated

    sequential = build_moe(grouped=False).cuda()
    grouped = build_moe(grouped=True, seed=5).cuda()
    grouped.load_state_dict(sequential_to_grouped_state(sequential.state_dict()), strict=False)
    ref = moe_logits(sequential, 9, "cuda")
    for model in (sequential, grouped):
        quantize_on(model, "NVFP4_DEFAULT_CFG", [0, 1], "cuda")
        check_calibrated(model)
    quantized = moe_logits(sequential, 9, "cuda")
    torch.testing.assert_close(moe_logits(grouped, 9, "cuda"), quantized, atol=1e-6, rtol=1e-6)
    error = ((quantized - ref).norm() / ref.norm()).item()
    assert 1e-4 < error < 0.25, f"NVFP4: relative logit error {error:.4g}"
