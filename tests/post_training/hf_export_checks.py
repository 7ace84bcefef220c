"""Shared parts of the quantized Hugging Face export tests: quantize a bridge-built Llama, read the export back.

Module level so that the TP=2 rank workers can import them.
"""

from __future__ import annotations

import json
import os

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.models.hf import AutoBridge
from tests.models.hf.hf_models import batch, safetensors_tensors


def quantized_llama(hf_dir: str, recipe: str = "FP8_DEFAULT_CFG"):
    """``(bridge, model)``: the bridge's GPTModel of ``hf_dir`` (this rank's TP shard), quantized after one batch."""
    import modelopt.torch.quantization as mtq

    from megatron_core.post_training.modelopt import register_quant_modules

    register_quant_modules()
    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    (model,) = bridge.to_megatron_model()
    model.eval()
    ids, pos = batch(3)
    mtq.quantize(model, getattr(mtq, recipe), lambda m: m(ids, pos, None))
    return bridge, model


def dequantized(out_dir: str) -> dict[str, torch.Tensor]:
    """The exported tensors with every FP8 weight times its ``weight_scale`` (scales themselves left out)."""
    stored = safetensors_tensors(out_dir)
    out = {}
    for name, tensor in stored.items():
        if name.endswith(("_scale",)):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = tensor.float() * stored[name.removesuffix(".weight") + ".weight_scale"]
        out[name] = tensor
    return out


def hf_config_without_quantization(out_dir: str):
    """The export's transformers config with ``quantization_config`` removed (transformers has no modelopt loader)."""
    import transformers

    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        data = json.load(f)
    data.pop("quantization_config")
    return transformers.LlamaConfig(**{k: v for k, v in data.items() if k not in ("architectures", "model_type")})


def export_at_tp2(hf_dir: str, out_dir: str) -> bool:
    """Import at TP=2, quantize with FP8, export (collective); True on every rank that finished."""
    from megatron_core.post_training.modelopt.hf_export import export_quantized_hf

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        bridge, model = quantized_llama(hf_dir)
        export_quantized_hf(bridge, model, out_dir)
        return True
    finally:
        parallel_state.destroy_model_parallel()
