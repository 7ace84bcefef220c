"""Post-training quantization of a tiny GPT with Model Optimizer's predefined recipes (fake quant, CPU).

Each recipe must put calibrated quantizers in every linear layer of every transformer layer, change the
logits (quantization happened) and keep them close to the unquantized model's: the relative error
``||q - ref|| / ||ref||`` of the logits stays below a bound per recipe, set from the recipe's precision
(8-bit formats: 2 %; 4-bit ones: 10 %) with a margin over what a random-weight model shows.
"""

from __future__ import annotations

import pytest
import torch

from tests.post_training.quant_test_utils import LINEARS, build, logits, quantize

# Relative logit error bounds (fraction of the logits' norm) per recipe.
TOLERANCE = {"FP8_DEFAULT_CFG": 0.08, "INT8_SMOOTHQUANT_CFG": 0.25, "INT4_AWQ_CFG": 0.25}


def _relative_error(quantized: torch.Tensor, ref: torch.Tensor) -> float:
    return ((quantized - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("recipe", sorted(TOLERANCE))
def test_every_linear_is_calibrated_and_logits_stay_close(recipe):
    model = build()
    ref = logits(model)
    quantize(model, recipe)
    for layer in model.decoder.layers:
        for name in LINEARS:
            linear = layer.get_submodule(name)
            assert type(linear).__name__.startswith("Quant"), f"{name}: {type(linear).__name__} was not converted"
            assert linear.weight_quantizer.is_enabled and linear.weight_quantizer.amax is not None, name
            if linear.input_quantizer.is_enabled:
                assert linear.input_quantizer.amax is not None, f"{name}: input quantizer not calibrated"
    error = _relative_error(logits(model), ref)
    assert 1e-4 < error < TOLERANCE[recipe], f"{recipe}: relative logit error {error:.4g}"


def test_output_layer_stays_unquantized_and_embedding_untouched():
    model = build()
    quantize(model, "FP8_DEFAULT_CFG")
    assert not model.output_layer.weight_quantizer.is_enabled  # the recipes leave the output layer alone
    assert not hasattr(model.embedding.word_embeddings, "weight_quantizer")


def test_calibration_without_batches_leaves_activation_quantizers_uncalibrated():
    from megatron_core.post_training.modelopt.calibration import check_calibrated

    model = build()
    quantize(model, "FP8_DEFAULT_CFG")
    check_calibrated(model)
    empty = build()
    import modelopt.torch.quantization as mtq

    mtq.quantize(empty, mtq.FP8_DEFAULT_CFG, lambda m: None)
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.self_attention\.linear_qkv\.input_quantizer"):
        check_calibrated(empty)



class _Parallel(torch.nn.Module):
    """fc1 (column-parallel) -> ReLU -> fc2 (row-parallel), TP=1."""

    def __init__(self) -> None:
        super().__init__()
        from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron_core.transformer import TransformerConfig

        cfg = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=4, use_cpu_initialization=True)
        self.fc1 = ColumnParallelLinear(128, 256, config=cfg, init_method=torch.nn.init.normal_, bias=True)
        self.fc2 = RowParallelLinear(256, 128, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                                     input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)[0]))[0]


class _Plain(torch.nn.Module):
    """The same computation on ``torch.nn.Linear``, which Model Optimizer quantizes natively."""

    def __init__(self, parallel: _Parallel) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(128, 256), torch.nn.Linear(256, 128)
        self.load_state_dict({k: v for k, v in parallel.state_dict().items() if not k.endswith("_extra_state")})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("recipe", sorted(TOLERANCE))
def test_parallel_linears_quantize_exactly_like_torch_linear(recipe):
    import modelopt.torch.quantization as mtq

    torch.manual_seed(0)
    calib, test = torch.randn(16, 2, 128), torch.randn(16, 2, 128)
    ours = _Parallel()
    plain = _Plain(ours)
    for model in (ours, plain):
        mtq.quantize(model, getattr(mtq, recipe), lambda m: m(calib))
    with torch.no_grad():
        torch.testing.assert_close(ours(test), plain(test), rtol=0, atol=0)
    for name in ("fc1", "fc2"):
        torch.testing.assert_close(getattr(ours, name).weight_quantizer.amax, getattr(plain, name).weight_quantizer.amax)


def test_config_names_resolve_and_unknown_names_are_refused_with_the_known_ones():
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt.recipes import get_quant_config, known_recipes

    config = get_quant_config("INT4_AWQ_CFG")
    assert config == mtq.INT4_AWQ_CFG and config is not mtq.INT4_AWQ_CFG
    assert "FP8_DEFAULT_CFG" in known_recipes()
    with pytest.raises(ValueError, match=r"'fp8_defualt_cfg' is not one Model Optimizer knows \(did you mean "
                                         r"FP8_DEFAULT_CFG.*known configs: .*INT4_AWQ_CFG, .*INT8_SMOOTHQUANT_CFG"):
        get_quant_config("fp8_defualt_cfg")


@pytest.mark.parametrize("recipe", ["FP8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG", "INT8_DEFAULT_CFG"])
def test_the_recipe_is_named_from_the_recorded_state(recipe):
    import modelopt.torch.opt as mto

    from megatron_core.post_training.modelopt.recipes import CUSTOM_RECIPE, recipe_of

    assert recipe_of(mto.modelopt_state(quantize(build(), recipe))) == recipe  # INT8 SQ and INT8: same quant_cfg
    custom = quantize_with(build(), {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                                                   {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8}}],
                                     "algorithm": "max"})
    assert recipe_of(mto.modelopt_state(custom)) == CUSTOM_RECIPE
    assert recipe_of(mto.modelopt_state(build())) == "none"


def quantize_with(model, config):
    import modelopt.torch.quantization as mtq

    from tests.post_training.quant_test_utils import calibrate

    return mtq.quantize(model, config, calibrate)



@pytest.mark.parametrize("real_quant_cfg", ["fp8_real_quant", "fp8_blockwise_real_quant"])
def test_real_quant_spec_stores_fp8_weights_and_runs(real_quant_cfg):
    """``get_gpt_modelopt_spec(real_quant_cfg=...)`` (Megatron-Core's weight-only real quantization) builds layers whose
    linear weights are stored compressed, frozen, and whose model still computes logits close to the same
    weights unquantized (weight-only FP8: 8 % of the logits' norm, as the FP8 recipe above)."""
    from megatron_core.models.gpt import GPTModel
    from megatron_core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec
    from tests.post_training.quant_test_utils import MAX_SEQ, VOCAB, config

    ref = build()
    cfg = config()
    torch.manual_seed(1234)
    model = GPTModel(cfg, get_gpt_modelopt_spec(cfg, local_core_attention=True, real_quant_cfg=real_quant_cfg),
                     VOCAB, MAX_SEQ, position_embedding_type="rope", parallel_output=False).eval()
    model.embedding.load_state_dict(ref.embedding.state_dict())
    model.output_layer.load_state_dict(ref.output_layer.state_dict())
    for layer in model.decoder.layers:
        for name in LINEARS:
            weight = layer.get_submodule(name).weight
            assert not weight.requires_grad
            assert weight.element_size() == 1, (name, weight.dtype)
    out = logits(model)
    assert torch.isfinite(out).all()
    # The same layers without compression: rebuild the reference from the compressed layers' dequantized weights.
    for quantized, plain in zip(model.decoder.layers, ref.decoder.layers):
        with torch.no_grad():
            for name in LINEARS:
                module = quantized.get_submodule(name)
                plain.get_submodule(name).weight.copy_(module.weight_quantizer(module.weight))
            for key, value in quantized.state_dict().items():
                if key.endswith("layernorm.weight") or key.endswith("layer_norm_weight"):
                    plain.state_dict()[key].copy_(value)
    assert _relative_error(out, logits(ref)) < TOLERANCE["FP8_DEFAULT_CFG"]
