"""Export a quantized GPTModel as a Hugging Face checkpoint in Model Optimizer's unified format.

Model Optimizer's ``export_hf_checkpoint`` writes a quantized Hugging Face model as: each quantized
linear's ``weight`` in the quantized dtype with its ``weight_scale`` (and ``input_scale`` where the
input is quantized) beside it, ``hf_quant_config.json`` naming the algorithm and the modules left
unquantized, and the same in ``config.json``'s ``quantization_config`` (``quant_method: modelopt``).
Megatron-LM reaches that format through Model Optimizer's Megatron exporter; here
:func:`export_quantized_hf` goes through this library's Hugging Face bridge
(:class:`~megatron_core.models.hf.AutoBridge`), so every architecture, TP/PP layout and name mapping the
bridge exports works the same:

1. the bridge exports the model with each quantized linear's weight replaced by its fake-quantized
   value (what the quantized model multiplies by), TP shards gathered as usual;
2. rank 0 rewrites each such HF tensor as FP8 codes (``weight / weight_scale``, exact: the fake-quantized
   value is an FP8 code times the scale) plus its scales, and writes the quantization config, inside the
   bridge's temporary directory before it is published: a failure leaves nothing at the target.

A fused Megatron weight (``linear_qkv``, a gated ``linear_fc1``) has one scale, which its HF parts (q, k, v;
gate, up) share, as Model Optimizer's own export makes fused HF projections share one.

Supported: FP8 per tensor (``FP8_DEFAULT_CFG``); other recipes raise ``ValueError`` naming the supported ones.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_core.dist_checkpointing import collectives
from megatron_core.models.hf.export import QUANT_CONFIG_FILE
from megatron_core.models.hf.model_view import unwrap
from megatron_core.models.hf.safetensors_io import INDEX_FILE, HFCheckpointReader, SafetensorsShardWriter
from megatron_core.post_training.modelopt._backend import modelopt_hf_config_format, modelopt_modules
from megatron_core.post_training.modelopt.recipes import recipe_of

__all__ = ["HF_QUANT_CONFIG", "SUPPORTED_EXPORT_RECIPES", "export_quantized_hf"]

HF_QUANT_CONFIG = QUANT_CONFIG_FILE
# recipe -> Model Optimizer's quant_algo in hf_quant_config.json
SUPPORTED_EXPORT_RECIPES = {"FP8_DEFAULT_CFG": "FP8"}
_FP8_MAX = 448.0  # largest E4M3 value: Model Optimizer's scale is amax / 448
_EXCLUDED = ["lm_head"]


def _quantized_linears(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, module in chunk.named_modules():
        quantizer = getattr(module, "weight_quantizer", None)
        if quantizer is not None and quantizer.is_enabled and isinstance(getattr(module, "weight", None), torch.Tensor):
            yield name, module


def _scale(quantizer: Any, name: str) -> float | None:
    if not quantizer.is_enabled or quantizer.amax is None:
        return None
    if quantizer.amax.numel() != 1:
        raise ValueError(f"{name}: {quantizer.amax.numel()} scales; only per-tensor scales are exported as FP8")
    return float(quantizer.amax.float()) / _FP8_MAX


def _hf_scales(bridge: Any, chunks: list[torch.nn.Module], pg_collection: Any) -> dict[str, tuple[float, float | None]]:
    """``{HF weight name: (weight_scale, input_scale or None)}`` of this rank's quantized linears (TP-agreed scales)."""
    out = {}
    for chunk in chunks:
        for name, module in _quantized_linears(chunk):
            if name.endswith("output_layer"):
                continue
            rule, layer = bridge.rule_for(chunk, f"{name}.weight", pg_collection)
            scales = (_scale(module.weight_quantizer, f"{name}.weight_quantizer"),
                      _scale(module.input_quantizer, f"{name}.input_quantizer"))
            for hf_name in rule.hf_names(layer):
                out[hf_name] = scales
    return out


@contextmanager
def _fake_quantized_weights(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Each quantized linear's weight holds its fake-quantized value inside; the original is put back after."""
    saved = []
    try:
        with torch.no_grad():
            for chunk in chunks:
                for _, module in _quantized_linears(chunk):
                    saved.append((module.weight, module.weight.detach().clone()))
                    module.weight.copy_(module.weight_quantizer(module.weight))
        yield
    finally:
        with torch.no_grad():
            for param, original in saved:
                param.copy_(original)


def _check_recipe(chunks: list[torch.nn.Module]) -> str:
    mo = modelopt_modules("exporting a quantized Hugging Face checkpoint")
    if not mo.mto.ModeloptStateManager.is_converted(chunks[0]):
        raise ValueError(f"{type(chunks[0]).__name__} is not quantized: export it with AutoBridge.save_hf_pretrained")
    recipe = recipe_of(mo.mto.modelopt_state(chunks[0]))
    if recipe not in SUPPORTED_EXPORT_RECIPES:
        raise ValueError(f"exporting a model quantized with {recipe} in Model Optimizer's unified Hugging Face "
                         f"format is not supported; supported recipes: {', '.join(SUPPORTED_EXPORT_RECIPES)}")
    return recipe


def export_quantized_hf(bridge: Any, model: torch.nn.Module | list[torch.nn.Module], path: str | os.PathLike, *,
                        max_shard_size: int | str = "5GB", overwrite: bool = False, progress: bool = False,
                        pg_collection: Any = None) -> None:
    """Write the quantized ``model`` (this rank's chunks) at ``path`` in Model Optimizer's unified HF format.

    Collective over every rank, like ``bridge.save_hf_pretrained``, whose arguments the last four are.
    ``ValueError`` for an unquantized model or a recipe not in :data:`SUPPORTED_EXPORT_RECIPES`.
    """
    chunks = [unwrap(c) for c in (model if isinstance(model, (list, tuple)) else [model])]
    recipe = _check_recipe(chunks)
    merged: dict[str, tuple[float, float | None]] = {}
    for part in collectives.all_gather_object(_hf_scales(bridge, chunks, pg_collection)):
        merged.update(part)

    def rewrite(directory: str) -> None:  # rank 0, inside the bridge's temporary directory: published only if it works
        _rewrite_as_fp8(directory, merged)
        _write_quant_config(directory, SUPPORTED_EXPORT_RECIPES[recipe], modelopt_modules().version, merged)

    with _fake_quantized_weights(chunks):
        bridge.save_hf_pretrained(chunks, path, max_shard_size=max_shard_size, overwrite=overwrite,
                                  progress=progress, pg_collection=pg_collection, finalize=rewrite)


def _rewrite_as_fp8(path: str, scales: dict[str, tuple[float, float | None]]) -> None:
    """Replace each scaled tensor of every safetensors file by FP8 codes plus ``weight_scale`` / ``input_scale``."""
    reader = HFCheckpointReader(path)
    files = sorted(set(reader.file_of.values()))
    new_map: dict[str, str] = {}
    total = 0
    for file_name in files:
        names = [n for n in reader.names() if reader.file_of[n] == file_name]
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            tensor = reader.read(name)
            if name not in scales:
                tensors[name] = tensor
                continue
            weight_scale, input_scale = scales[name]
            tensors[name] = (tensor.float() / weight_scale).to(torch.float8_e4m3fn)
            stem = name.removesuffix(".weight")
            tensors[f"{stem}.weight_scale"] = torch.tensor(weight_scale, dtype=torch.float32)
            if input_scale is not None:
                tensors[f"{stem}.input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
        tmp = os.path.join(path, f"{file_name}.tmp")
        writer = SafetensorsShardWriter(tmp, [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
        for name, tensor in tensors.items():
            writer.write(name, tensor)
            new_map[name] = file_name
            total += tensor.numel() * tensor.element_size()
        writer.close()
        os.replace(tmp, os.path.join(path, file_name))
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        _write_json(index_path, {"metadata": {"total_size": total}, "weight_map": dict(sorted(new_map.items()))})


def _write_quant_config(path: str, quant_algo: str, version: str, scales: dict[str, Any]) -> None:
    """``hf_quant_config.json`` and ``config.json``'s ``quantization_config``, as Model Optimizer writes them."""
    hf_quant_config = {
        "producer": {"name": "modelopt", "version": version},
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None, "exclude_modules": list(_EXCLUDED)},
    }
    _write_json(os.path.join(path, HF_QUANT_CONFIG), hf_quant_config)
    config_path = os.path.join(path, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = modelopt_hf_config_format().convert_hf_quant_config_format(hf_quant_config)
    _write_json(config_path, config)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
