"""Export of a quantized GPTModel to Model Optimizer's unified Hugging Face format (post_training.modelopt.hf_export).

A tiny random Llama (``save_pretrained``) is imported through the bridge, quantized with FP8 and exported. The
export holds FP8 weights with their scales for every quantized projection and the unquantized rest; its
dequantized weights are the model's fake-quantized ones (each FP8 code times its scale reproduces the
fake-quantized value: 1e-6 relative, the rounding of one division); transformers' ``LlamaForCausalLM``
loaded with the dequantized weights gives the logits of our model with the same weights (input quantizers
off, since transformers does not quantize activations): fp32, 1e-5. At TP=2 the export equals TP=1's.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist_harness import run_on_ranks
from tests.models.hf.hf_models import batch, make_hf_model, safetensors_tensors
from tests.post_training.hf_export_checks import (
    dequantized,
    export_at_tp2,
    hf_config_without_quantization,
    quantized_llama,
)

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "hf"
    make_hf_model("llama", path)
    return str(path)


@pytest.fixture(scope="module")
def exported(llama_dir, tmp_path_factory):
    from megatron_core.post_training.modelopt.hf_export import export_quantized_hf

    bridge, model = quantized_llama(llama_dir)
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    out = str(tmp_path_factory.mktemp("export") / "fp8")
    export_quantized_hf(bridge, model, out)
    return bridge, model, before, out


def test_files_hold_fp8_weights_scales_and_the_quantization_config(exported):
    import modelopt

    _, _, _, out = exported
    with open(os.path.join(out, "hf_quant_config.json"), encoding="utf-8") as f:
        assert json.load(f) == {"producer": {"name": "modelopt", "version": modelopt.__version__},
                                "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                                 "exclude_modules": ["lm_head", "model.embed_tokens"]}}
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        quantization = json.load(f)["quantization_config"]
    assert quantization["quant_method"] == "modelopt" and quantization["quant_algo"] == "FP8"
    tensors = safetensors_tensors(out)
    for layer in range(2):
        for proj in PROJECTIONS:
            stem = f"model.layers.{layer}.{proj}"
            assert tensors[f"{stem}.weight"].dtype == torch.float8_e4m3fn, stem
            assert tensors[f"{stem}.weight_scale"].shape == () and tensors[f"{stem}.input_scale"].shape == ()
    unquantized = [n for n, t in tensors.items() if t.dtype != torch.float8_e4m3fn and not n.endswith("_scale")]
    assert sorted(unquantized) == sorted(n for n in tensors if n.startswith(("lm_head", "model.embed_tokens",
                                                                              "model.norm")) or "layernorm" in n)
    assert all(t.dtype == torch.float32 for n, t in tensors.items() if n in unquantized)


def test_dequantized_weights_are_the_fake_quantized_ones_and_the_model_is_unchanged(exported):
    bridge, model, before, out = exported
    after = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)
    stored = dequantized(out)
    checked = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            quantizer = getattr(module, "weight_quantizer", None)
            if quantizer is None or not quantizer.is_enabled:
                continue
            rule, layer = bridge.rule_for(model, f"{name}.weight")
            for hf_name, ours in rule.to_hf([quantizer(module.weight)], layer).items():
                torch.testing.assert_close(stored[hf_name], ours, rtol=1e-6, atol=0, msg=hf_name)
                checked += 1
    assert checked == 2 * len(PROJECTIONS)


def test_transformers_with_the_dequantized_weights_gives_our_weight_quantized_logits(exported):
    import transformers

    from tests.models.hf.hf_models import eval_logits

    _, model, _, out = exported
    hf = transformers.LlamaForCausalLM(hf_config_without_quantization(out)).eval()
    hf.config._attn_implementation = "eager"
    hf.load_state_dict(dequantized(out), strict=True)
    ids, pos = batch()
    inputs = [m for n, m in model.named_modules() if n.endswith("input_quantizer") and m.is_enabled]
    assert inputs
    for quantizer in inputs:
        quantizer.disable()
    try:
        ours = eval_logits(model, ids, pos)
    finally:
        for quantizer in inputs:
            quantizer.enable()
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_tp2_export_equals_tp1(exported, llama_dir, tmp_path):
    _, _, _, out = exported
    out2 = str(tmp_path / "fp8_tp2")
    assert run_on_ranks(2, export_at_tp2, llama_dir, out2, timeout=280) == [True, True]
    ours, theirs = safetensors_tensors(out2), safetensors_tensors(out)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name].float(), tensor.float(), rtol=1e-6, atol=0, msg=name)


def test_unquantized_and_unsupported_models_are_refused(llama_dir, tmp_path):
    from megatron_core.models.hf import AutoBridge
    from megatron_core.post_training.modelopt.hf_export import export_quantized_hf

    bridge = AutoBridge.from_hf_pretrained(llama_dir)
    (plain,) = bridge.to_megatron_model()
    with pytest.raises(ValueError, match="is not quantized: export it with AutoBridge.save_hf_pretrained"):
        export_quantized_hf(bridge, plain, tmp_path / "a")
    bridge, model = quantized_llama(llama_dir, "INT8_DEFAULT_CFG")
    with pytest.raises(ValueError, match="quantized with INT8_DEFAULT_CFG .* not supported; supported recipes: "
                                         "FP8_DEFAULT_CFG, INT8_SMOOTHQUANT_CFG, INT4_AWQ_CFG, NVFP4_DEFAULT_CFG"):
        export_quantized_hf(bridge, model, tmp_path / "b")
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_a_failed_rewrite_publishes_nothing_and_keeps_an_earlier_export(exported, llama_dir, tmp_path, monkeypatch):
    from megatron_core.post_training.modelopt import hf_export

    bridge, model, _, out = exported
    target = tmp_path / "fp8"
    hf_export.export_quantized_hf(bridge, model, target)
    before = sorted(os.listdir(target))

    def broken(*args, **kwargs):
        raise OSError("disk full while writing hf_quant_config.json")

    monkeypatch.setattr(hf_export, "_write_quant_config", broken)
    with pytest.raises(Exception, match="disk full"):
        hf_export.export_quantized_hf(bridge, model, target, overwrite=True)
    with pytest.raises(Exception, match="disk full"):
        hf_export.export_quantized_hf(bridge, model, tmp_path / "fresh")
    assert not os.path.exists(tmp_path / "fresh")
    assert sorted(os.listdir(target)) == before  # the earlier export is untouched
    assert sorted(os.listdir(tmp_path)) == ["fp8"]  # no temporary directory left behind
    monkeypatch.undo()
    hf_export.export_quantized_hf(bridge, model, target, overwrite=True)  # an export may replace an export
