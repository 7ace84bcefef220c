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
2. rank 0 rewrites each such HF tensor in the recipe's quantized form (codes plus scales, requantized from the
   fake-quantized value, so the codes are those the model multiplies by) and writes the quantization config,
   inside the bridge's temporary directory before it is published: a failure leaves nothing at the target.

The quantizer values (amax, pre-quantization scales) of every rank's linears are gathered to rank 0 and split
to HF tensors with the bridge's own rules (TP shards joined; pipeline stages each send their own layers), so
every TP/PP layout exports the same files. The per-recipe rules are in :mod:`.hf_export_formats`: FP8 per
tensor (``FP8_DEFAULT_CFG``), INT8 SmoothQuant (``INT8_SMOOTHQUANT_CFG``), INT4 AWQ (``INT4_AWQ_CFG``) and
NVFP4 (``NVFP4_DEFAULT_CFG``); other recipes raise ``ValueError`` naming the supported ones. A fused Megatron
weight (``linear_qkv``, a gated ``linear_fc1``) has one quantizer, whose per-tensor scales its HF parts (q, k,
v; gate, up) share, as Model Optimizer's own export makes fused HF projections share them.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_core.dist_checkpointing import collectives
from megatron_core.models.hf.export import QUANT_CONFIG_FILE
from megatron_core.models.hf.model_view import unwrap
from megatron_core.models.hf.safetensors_io import INDEX_FILE, HFCheckpointReader, SafetensorsShardWriter
from megatron_core.post_training.modelopt._backend import modelopt_hf_config_format, modelopt_modules
from megatron_core.post_training.modelopt.hf_export_formats import (
    EXPORT_FORMATS,
    ExportFormat,
    HFQuantInfo,
    LinearQuantInfo,
    hf_quant_info,
    linear_quant_info,
    quantized_tensors,
)
from megatron_core.post_training.modelopt.recipes import recipe_of
from megatron_core.tensor_parallel import layers as tp_layers

__all__ = ["HF_QUANT_CONFIG", "SUPPORTED_EXPORT_RECIPES", "export_quantized_hf"]

HF_QUANT_CONFIG = QUANT_CONFIG_FILE
# recipe -> Model Optimizer's quant_algo in hf_quant_config.json
SUPPORTED_EXPORT_RECIPES = {recipe: fmt.quant_algo for recipe, fmt in EXPORT_FORMATS.items()}


def _quantized_linears(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, module in chunk.named_modules():
        quantizer = getattr(module, "weight_quantizer", None)
        if quantizer is not None and quantizer.is_enabled and isinstance(getattr(module, "weight", None), torch.Tensor):
            yield name, module


def _layout(module: torch.nn.Module) -> str:
    if isinstance(module, tp_layers.ColumnParallelLinear):
        return "column"
    return "row" if isinstance(module, tp_layers.RowParallelLinear) else "none"


def _tp_rank(module: torch.nn.Module) -> int:
    group = getattr(module, "tp_group", None)
    if group is None or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank(group)


def _input_norm(bridge: Any, chunk: torch.nn.Module, name: str, pg_collection: Any) -> tuple[str, ...]:
    """HF names of the norm (weight, bias) whose output is ``name``'s input: q/k/v's and gate/up's norms."""
    params = dict(chunk.named_parameters())
    block, _, leaf = name.rpartition(".")
    layer = block.rpartition(".")[0]
    norm = {"linear_qkv": "input_layernorm", "linear_fc1": "pre_mlp_layernorm"}.get(leaf)
    candidates = [f"{name}.layer_norm_weight", f"{name}.layer_norm_bias"]
    if norm is not None:
        candidates += [f"{layer}.{norm}.weight", f"{layer}.{norm}.bias"]
    out = []
    for param in candidates:
        if param in params:
            rule, index = bridge.rule_for(chunk, param, pg_collection)
            out.extend(rule.hf_names(index))
    return tuple(out)


def _linear_infos(bridge: Any, chunks: list[torch.nn.Module], pg_collection: Any) -> list[LinearQuantInfo]:
    """This rank's :class:`LinearQuantInfo` of every quantized linear but the output layer."""
    out = []
    for chunk in chunks:
        for name, module in _quantized_linears(chunk):
            if name.endswith("output_layer"):
                continue
            rule, layer = bridge.rule_for(chunk, f"{name}.weight", pg_collection)
            out.append(linear_quant_info(module, name, rule, layer, _tp_rank(module), _layout(module),
                                         _input_norm(bridge, chunk, name, pg_collection)))
    return out


def _hf_infos(infos: list[LinearQuantInfo], fmt: ExportFormat) -> dict[str, HFQuantInfo]:
    """Every rank's linear infos joined per Megatron weight and split to ``{HF weight name: HFQuantInfo}``."""
    by_weight: dict[tuple[str, str], list[LinearQuantInfo]] = defaultdict(list)
    for info in infos:
        by_weight[(info.rule.mcore, repr(info.layer))].append(info)
    out: dict[str, HFQuantInfo] = {}
    for shards in by_weight.values():
        out.update(hf_quant_info(shards, fmt))
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
    fmt = EXPORT_FORMATS[_check_recipe(chunks)]
    zero_centered = bool(getattr(chunks[0].config, "layernorm_zero_centered_gamma", False))
    gathered = collectives.all_gather_object(_linear_infos(bridge, chunks, pg_collection))

    def rewrite(directory: str) -> None:  # rank 0, inside the bridge's temporary directory: published only if it works
        infos = _hf_infos([info for part in gathered for info in part], fmt)
        excluded = _rewrite_quantized(directory, fmt, infos, zero_centered)
        _write_quant_config(directory, fmt, modelopt_modules().version, excluded)

    with _fake_quantized_weights(chunks):
        bridge.save_hf_pretrained(chunks, path, max_shard_size=max_shard_size, overwrite=overwrite,
                                  progress=progress, pg_collection=pg_collection, finalize=rewrite)


def _rewrite_quantized(path: str, fmt: ExportFormat, infos: dict[str, HFQuantInfo], zero_centered: bool
                       ) -> list[str]:
    """Replace each quantized HF weight by its quantized tensors (and fold AWQ scales into norms), file by file.

    Returns the modules left unquantized (those with an unquantized weight matrix), sorted.
    """
    reader = HFCheckpointReader(path)
    files = sorted(set(reader.file_of.values()))
    folds = {norm: info.pre_quant_scale for info in infos.values() for norm in info.fold_into}
    new_map: dict[str, str] = {}
    excluded = []
    total = 0
    for file_name in files:
        names = [n for n in reader.names() if reader.file_of[n] == file_name]
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            tensor = reader.read(name)
            if name in infos:
                tensors.update(quantized_tensors(fmt, name.removesuffix(".weight"), tensor, infos[name]))
                continue
            if name in folds:
                tensor = _folded_norm(tensor, folds[name], zero_centered and name.endswith("weight"))
            elif tensor.ndim == 2 and name.endswith(".weight"):
                excluded.append(name.removesuffix(".weight"))
            tensors[name] = tensor
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
    return sorted(excluded)


def _folded_norm(tensor: torch.Tensor, scale: torch.Tensor, plus_one: bool) -> torch.Tensor:
    """A norm's weight or bias times the AWQ scale of the projections it feeds (``(1 + w) * s - 1`` when the
    norm's weight is zero-centred), as Model Optimizer folds it."""
    scale = scale.to(tensor.device)
    folded = (tensor + 1.0) * scale - 1.0 if plus_one else tensor * scale
    return folded.to(tensor.dtype)


def _write_quant_config(path: str, fmt: ExportFormat, version: str, excluded: list[str]) -> None:
    """``hf_quant_config.json`` and ``config.json``'s ``quantization_config``, as Model Optimizer writes them."""
    hf_quant_config = {
        "producer": {"name": "modelopt", "version": version},
        "quantization": {"quant_algo": fmt.quant_algo, "kv_cache_quant_algo": None, **fmt.config,
                         "exclude_modules": excluded},
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
