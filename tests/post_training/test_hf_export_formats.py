"""INT8 SmoothQuant, INT4 AWQ and NVFP4 export in Model Optimizer's unified Hugging Face format, and the export
under tensor and pipeline parallelism (post_training.modelopt.hf_export).

A tiny random Llama (hidden 256, so INT4's 128-wide blocks fit, also per TP=2 shard) is imported through the
bridge, quantized with the recipe and exported. The oracle is Model Optimizer's own ``export_hf_checkpoint`` of
the transformers Llama quantized with the same recipe and then given our weights and quantizer values
(``hf_export_checks.mirror_into_hf``): the two directories hold the same tensors (names, dtypes, shapes; codes
equal, scales to 1e-6 relative: both divide the same amax by the same bound; Model Optimizer averages the equal
q/k/v pre-quantization scales, which moves them by an ulp), the same ``hf_quant_config.json``
and ``quantization_config``. The dequantized weights (decoded here from the formats' definitions) are our
fake-quantized ones (1e-6 relative: a code times its scale against Model Optimizer's fake quantization of the
same value). Where the fake-quantized value sits at a rounding midpoint, requantizing it may part from Model
Optimizer's rounding of the weight by one code (at most 1e-4 of the codes; measured 1 in 1.1 M). transformers has no CPU loader for these formats, so a ``LlamaForCausalLM`` gets the dequantized
weights (each ``pre_quant_scale`` multiplied into its weight's input columns; AWQ's others are already in the
norms) and gives our logits with input quantizers off (their pre-quantization scales still applied): 1e-5.
TP=2 (INT8 SmoothQuant and INT4 AWQ) and PP=2 (INT4 AWQ) exports equal TP=1's (one pool call): the files are
written from the model as it is, but TP=2's calibration sums the row-parallel outputs in another order, which
moves the second layer's amax and smoothing scales by float noise (measured 6e-7 relative; bound 1e-5), and
codes by one step where they sit at a midpoint. AWQ at TP=2 picks one process's scales also for the
row-parallel o_proj / down_proj (``awq_tp``). NVFP4 fake quantization needs CUDA in Model Optimizer 0.47,
so its test is ``gpu``.

Kept fast: the model is imported and each recipe calibrated and exported once per module (shared by the tests),
on one batch of 2 x 12 tokens; AWQ-lite searches ``alpha`` over 0, 0.5, 1 (``hf_export_checks.recipe_config``),
and the oracle's transformers Llama is max-calibrated (the mirror overwrites its values). Hidden 256 everywhere:
the TP=2 export is compared with these TP=1 exports, and INT4 blocks must fit in its row-parallel shards.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("modelopt")

from tests.dist_harness import run_on_ranks  # noqa: E402
from tests.models.hf.hf_models import batch, eval_logits, make_hf_model, safetensors_tensors  # noqa: E402
from tests.post_training.hf_export_checks import (  # noqa: E402
    dequantize,
    dequantized,
    export_at_pp2,
    export_at_tp2,
    hf_config_without_quantization,
    oracle_export,
    quantized_llama,
)

CPU_RECIPES = ("INT8_SMOOTHQUANT_CFG", "INT4_AWQ_CFG")
# Our codes requantize the fake-quantized weight, Model Optimizer's the weight: at a rounding midpoint the two
# roundings may part by one code (measured: 1 of 1.1 M INT8 codes).
CODE_TIES = 1e-4
TP2_RECIPES = CPU_RECIPES
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama256") / "hf"
    make_hf_model("llama", path, **SIZES)
    return str(path)


@pytest.fixture(scope="module")
def exports(llama_dir, tmp_path_factory):
    """``{recipe: (bridge, model, our export, Model Optimizer's export)}``, built on first use."""
    from megatron_core.post_training.modelopt.hf_export import export_quantized_hf

    cache = {}

    def get(recipe: str, device: str = "cpu"):
        if recipe not in cache:
            bridge, model = quantized_llama(llama_dir, recipe, device)
            root = tmp_path_factory.mktemp(recipe)
            ours, theirs = str(root / "ours"), str(root / "modelopt")
            export_quantized_hf(bridge, model, ours)
            oracle_export(llama_dir, bridge, model, recipe, theirs, device)
            cache[recipe] = bridge, model, ours, theirs
        return cache[recipe]

    return get


def _same_files(ours: str, theirs: str, rtol: float = 1e-6) -> int:
    """Assert the two exports hold the same tensors and quantization config; returns the tensors compared."""
    for name in ("hf_quant_config.json", "config.json"):
        with open(os.path.join(ours, name), encoding="utf-8") as f, open(os.path.join(theirs, name), encoding="utf-8") as g:
            a, b = json.load(f), json.load(g)
        if name == "config.json":
            a, b = a["quantization_config"], b["quantization_config"]
        assert a == b, name
    mine, oracle = safetensors_tensors(ours), safetensors_tensors(theirs)
    assert sorted(mine) == sorted(oracle)
    differing, codes = 0, 0
    for name, tensor in oracle.items():
        assert mine[name].dtype == tensor.dtype and mine[name].shape == tensor.shape, name
        stem = name.removesuffix(".weight")
        if f"{stem}.weight_scale" in oracle:  # codes: compared as values, one code step apart at most
            a, b = dequantize(mine, stem), dequantize(oracle, stem)
            step = _code_step(oracle, stem, b.shape)
            assert ((a - b).abs() <= step * 1.0001).all(), name
            differing, codes = differing + int(((a - b).abs() > step / 2).sum()), codes + a.numel()
        else:
            torch.testing.assert_close(mine[name].float(), tensor.float(), rtol=rtol, atol=0, msg=name)
    print(f"{ours}: {differing} of {codes} codes one step from Model Optimizer's")
    assert differing <= CODE_TIES * codes
    return len(oracle)


def _code_step(tensors: dict, stem: str, shape: torch.Size) -> torch.Tensor:
    """The largest distance between neighbouring dequantized codes of each weight entry."""
    scale = tensors[f"{stem}.weight_scale"].float()
    if scale.ndim == 0:
        return scale.expand(shape)
    if scale.ndim == 1:
        return scale[:, None].expand(shape)
    if f"{stem}.weight_scale_2" in tensors:  # E2M1 codes are at most 2 apart (4 -> 6)
        scale = 2 * scale * tensors[f"{stem}.weight_scale_2"].float()
    return scale.repeat_interleave(shape[1] // scale.shape[1], dim=1)


def _check_dequantized(bridge, model, out: str) -> int:
    stored = dequantized(out)
    checked = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            quantizer = getattr(module, "weight_quantizer", None)
            if quantizer is None or not quantizer.is_enabled or name.endswith("output_layer"):
                continue
            rule, layer = bridge.rule_for(model, f"{name}.weight")
            for hf_name, ours in rule.to_hf([quantizer(module.weight).cpu()], layer).items():
                torch.testing.assert_close(stored[hf_name], ours, rtol=1e-6, atol=1e-9, msg=hf_name)
                checked += 1
    return checked


@pytest.mark.parametrize("recipe", CPU_RECIPES)
def test_files_equal_model_optimizers_own_export(exports, recipe):
    _, _, ours, theirs = exports(recipe)
    assert _same_files(ours, theirs) > 2 * 7 * 2
    tensors = safetensors_tensors(ours)
    stem = "model.layers.0.self_attn.o_proj"
    if recipe == "INT4_AWQ_CFG":
        assert tensors[f"{stem}.weight"].dtype == torch.uint8 and tensors[f"{stem}.weight"].shape == (128, 256)
        assert tensors[f"{stem}.weight_scale"].shape == (256, 2) and f"{stem}.pre_quant_scale" in tensors
        assert "model.layers.0.self_attn.q_proj.pre_quant_scale" not in tensors  # folded into the input norm
    else:
        assert tensors[f"{stem}.weight"].dtype == torch.int8 and tensors[f"{stem}.weight_scale"].shape == (256,)
        assert tensors[f"{stem}.input_scale"].shape == () and f"{stem}.pre_quant_scale" in tensors


@pytest.mark.parametrize("recipe", CPU_RECIPES)
def test_dequantized_weights_are_our_fake_quantized_ones(exports, recipe):
    bridge, model, ours, _ = exports(recipe)
    assert _check_dequantized(bridge, model, ours) == 2 * 7


@pytest.mark.parametrize("recipe", CPU_RECIPES)
def test_transformers_with_the_dequantized_weights_gives_our_logits(exports, recipe):
    import transformers

    _, model, ours, _ = exports(recipe)
    hf = transformers.LlamaForCausalLM(hf_config_without_quantization(ours)).eval()
    hf.config._attn_implementation = "eager"
    hf.load_state_dict(dequantized(ours, fold_pre_quant_scale=True), strict=True)
    ids, pos = batch()
    inputs = [m for n, m in model.named_modules() if n.endswith("input_quantizer") and m.is_enabled]
    for quantizer in inputs:
        quantizer.disable()
    try:
        mine = eval_logits(model, ids, pos)
    finally:
        for quantizer in inputs:
            quantizer.enable()
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def _tp2_and_pp2(hf_dir: str, out_dir: str) -> bool:
    export_at_tp2(hf_dir, os.path.join(out_dir, "tp2"), TP2_RECIPES)
    return export_at_pp2(hf_dir, os.path.join(out_dir, "pp2"), "INT4_AWQ_CFG")


def test_tp2_and_pp2_exports_equal_tp1(exports, llama_dir, tmp_path):
    assert run_on_ranks(2, _tp2_and_pp2, llama_dir, str(tmp_path), timeout=400) == [True, True]
    for out, recipe in [(tmp_path / "tp2" / r, r) for r in TP2_RECIPES] + [(tmp_path / "pp2", "INT4_AWQ_CFG")]:
        _, _, ours, _ = exports(recipe)
        assert _same_files(str(out), ours, rtol=1e-5) > 2 * 7 * 2, out


@pytest.mark.gpu
def test_nvfp4_export_on_gpu(exports):
    bridge, model, ours, theirs = exports("NVFP4_DEFAULT_CFG", "cuda")
    assert _same_files(ours, theirs) > 2 * 7 * 4
    tensors = safetensors_tensors(ours)
    stem = "model.layers.0.mlp.down_proj"
    assert tensors[f"{stem}.weight"].dtype == torch.uint8 and tensors[f"{stem}.weight"].shape == (256, 256)
    assert tensors[f"{stem}.weight_scale"].dtype == torch.float8_e4m3fn
    assert tensors[f"{stem}.weight_scale"].shape == (256, 32)
    assert tensors[f"{stem}.weight_scale_2"].shape == () and tensors[f"{stem}.input_scale"].shape == ()
    assert _check_dequantized(bridge, model, ours) == 2 * 7
