"""Shared parts of the quantized Hugging Face export tests: quantize a bridge-built Llama, read the export back.

Module level so that the TP=2 rank workers can import them.
"""

from __future__ import annotations

import copy
import json
import os

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.models.hf import AutoBridge
from tests.models.hf.hf_models import batch, safetensors_tensors


def recipe_config(recipe: str) -> dict:
    """Model Optimizer's predefined ``recipe`` with AWQ-lite's ``alpha`` searched over 0, 0.5 and 1 only: the
    tests check where the scales go, not how good they are, and 3 candidates instead of 11 keep them fast."""
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, recipe))
    if isinstance(cfg["algorithm"], dict) and cfg["algorithm"].get("method") == "awq_lite":
        cfg["algorithm"]["alpha_step"] = 0.5
    return cfg


def quantized_llama(hf_dir: str, recipe: str = "FP8_DEFAULT_CFG", device: str = "cpu"):
    """``(bridge, model)``: the bridge's GPTModel of ``hf_dir`` (this rank's TP shard) on ``device``, quantized
    with :func:`recipe_config` after one batch."""
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt import register_quant_modules

    register_quant_modules()
    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    (model,) = bridge.to_megatron_model()
    model.eval().to(device)
    ids, pos = (t.to(device) for t in batch(3))
    mtq.quantize(model, recipe_config(recipe), lambda m: m(ids, pos, None))
    return bridge, model


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _nibbles(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (packed & 0x0F).long(), (packed >> 4).long()


def dequantize(tensors: dict[str, torch.Tensor], stem: str) -> torch.Tensor:
    """``<stem>.weight`` of an export as floats: codes times scales, whichever format (written independently
    of Model Optimizer, from the format's definition)."""
    weight, scale = tensors[f"{stem}.weight"], tensors[f"{stem}.weight_scale"].float()
    if weight.dtype == torch.float8_e4m3fn:
        return weight.float() * scale
    if weight.dtype == torch.int8:  # per output channel
        return weight.float() * scale[:, None]
    low, high = _nibbles(weight)
    if f"{stem}.weight_scale_2" in tensors:  # NVFP4: two E2M1 codes per byte along the input dim, 16-wide blocks
        codes = torch.stack((low, high), dim=-1).reshape(weight.shape[0], -1)
        block = codes.shape[1] // scale.shape[1]
        return _E2M1[codes] * (scale * tensors[f"{stem}.weight_scale_2"].float()).repeat_interleave(block, dim=1)
    rows = torch.empty(weight.shape[0] * 2, weight.shape[1])  # INT4: rows 2j (low nibble) and 2j+1 (high)
    rows[0::2], rows[1::2] = low.float(), high.float()
    rows = torch.where(rows >= 8, rows - 16, rows)
    return rows * scale.repeat_interleave(rows.shape[1] // scale.shape[1], dim=1)


def dequantized(out_dir: str, fold_pre_quant_scale: bool = False) -> dict[str, torch.Tensor]:
    """The exported tensors with every quantized weight dequantized (scales themselves left out); with
    ``fold_pre_quant_scale`` a weight's ``pre_quant_scale`` is multiplied into its input columns, which makes
    the state dict of a plain transformers model computing what the quantized one does."""
    stored = safetensors_tensors(out_dir)
    out = {}
    for name, tensor in stored.items():
        if name.endswith(("_scale", "_scale_2")):
            continue
        stem = name.removesuffix(".weight")
        if f"{stem}.weight_scale" in stored:
            tensor = dequantize(stored, stem)
            if fold_pre_quant_scale and f"{stem}.pre_quant_scale" in stored:
                tensor = tensor * stored[f"{stem}.pre_quant_scale"].float()[None, :]
        out[name] = tensor
    return out


def mirror_into_hf(bridge, model, hf) -> None:
    """Give the quantized transformers model ``hf`` our quantized ``model``'s weights and quantizer values
    (amax, pre-quantization scales), so Model Optimizer's own export of ``hf`` is the oracle of ours."""
    hf_params = dict(hf.named_parameters())
    hf_modules = dict(hf.named_modules())
    with torch.no_grad():
        for name, param in model.named_parameters():
            rule, layer = bridge.rule_for(model, name)
            for hf_name, value in rule.to_hf([param.detach().cpu()], layer).items():
                hf_params[hf_name].copy_(value)
        for name, module in model.named_modules():
            quantizer = getattr(module, "weight_quantizer", None)
            if quantizer is None or not quantizer.is_enabled or name.endswith("output_layer"):
                continue
            rule, layer = bridge.rule_for(model, f"{name}.weight")
            amax = quantizer.amax.detach().cpu()
            split = rule.to_hf([amax.reshape(module.weight.shape[0], -1)], layer) if amax.numel() > 1 else None
            for hf_name in rule.hf_names(layer):
                theirs = hf_modules[hf_name.removesuffix(".weight")]
                mine = amax if split is None else split[hf_name]
                theirs.weight_quantizer.amax = mine.reshape(theirs.weight_quantizer.amax.shape).to(hf.device)
                if module.input_quantizer.is_enabled and module.input_quantizer.amax is not None:
                    theirs.input_quantizer.amax = module.input_quantizer.amax.detach().reshape(
                        theirs.input_quantizer.amax.shape).to(hf.device)
                if module.input_quantizer.pre_quant_scale is not None:
                    theirs.input_quantizer.pre_quant_scale = module.input_quantizer.pre_quant_scale.detach().to(
                        hf.device)


def oracle_export(hf_dir: str, bridge, model, recipe: str, out_dir: str, device: str = "cpu") -> None:
    """Model Optimizer's ``export_hf_checkpoint`` of the transformers Llama of ``hf_dir`` quantized with ``recipe``
    and holding our quantized ``model``'s weights and quantizer values (:func:`mirror_into_hf`). Its calibration
    is max calibration whatever the recipe's algorithm: the mirror overwrites every value it would compute."""
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint

    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval().to(device)
    ids, _ = batch(3)
    mtq.quantize(hf, {**getattr(mtq, recipe), "algorithm": "max"}, lambda m: m(ids.to(device)))
    mirror_into_hf(bridge, model, hf)
    export_hf_checkpoint(hf, export_dir=out_dir)


def hf_config_without_quantization(out_dir: str):
    """The export's transformers config with ``quantization_config`` removed (transformers has no modelopt loader)."""
    import transformers

    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        data = json.load(f)
    data.pop("quantization_config")
    return transformers.LlamaConfig(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")})


def export_at_tp2(hf_dir: str, out_dir: str, recipes: tuple[str, ...] = ("FP8_DEFAULT_CFG",)) -> bool:
    """Import at TP=2, quantize with each recipe, export each to ``<out_dir>/<recipe>`` (a single recipe: to
    ``out_dir``; collective); True on every rank that finished."""
    from megatron_core.post_training.modelopt.hf_export import export_quantized_hf

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        for recipe in recipes:
            bridge, model = quantized_llama(hf_dir, recipe)
            export_quantized_hf(bridge, model, out_dir if len(recipes) == 1 else os.path.join(out_dir, recipe))
        return True
    finally:
        parallel_state.destroy_model_parallel()


def export_at_pp2(hf_dir: str, out_dir: str, recipe: str) -> bool:
    """Import at PP=2 (one layer per stage), quantize with ``recipe`` calibrating through the pipeline schedule,
    export (collective); True on every rank that finished."""
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt import register_quant_modules
    from megatron_core.post_training.modelopt.hf_export import export_quantized_hf
    from tests.post_training.quant_test_utils import pipeline_forward

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        register_quant_modules()
        bridge = AutoBridge.from_hf_pretrained(hf_dir)
        (model,) = bridge.to_megatron_model()
        model.eval()
        assert len(model.decoder.layers) == 1
        ids, pos = batch(3)
        mtq.quantize(model, recipe_config(recipe), lambda m: pipeline_forward(m, ids, pos))
        export_quantized_hf(bridge, model, out_dir)
        return True
    finally:
        parallel_state.destroy_model_parallel()
