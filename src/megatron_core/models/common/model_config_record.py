"""The whole model configuration, recorded as JSON in a checkpoint so that inference rebuilds exactly that model.

``save_checkpoint`` stores, under ``model_config`` in the common state, one JSON string: every
``TransformerConfig`` field that shapes the forward (attention windows, RoPE and YaRN settings,
norms, activations, MoE, MLA, MTP, dtypes...), the config class, and the model-level settings a
``GPTModel`` is built with (vocabulary size, maximum length, position-embedding type, tied
embeddings, the rotary inverse frequencies themselves, which carry any RoPE scaling such as
Llama 3's). Fields that describe how a run was laid out or trained (parallel sizes, communication
overlap, recomputation, initialisation, offloading) are left out: a reader chooses its own.
Functions and enums are stored by import path and resolved only inside ``torch`` and
``megatron_core``; nothing is unpickled. Not in Megatron-Core (which rebuilds from ``args``).

It lives with the models (it describes one, and the Hugging Face converter writes it for the checkpoints it
makes); :mod:`megatron_core.training.model_config` is its home path for users.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
from typing import Any

import torch

from megatron_core._wrapped_model import innermost_module

__all__ = [
    "FORMAT_VERSION", "MODEL_CONFIG_KEY", "model_config_record", "model_config_record_for", "parse_model_config",
    "transformer_config_from_record",
]

MODEL_CONFIG_KEY = "model_config"
FORMAT_VERSION = 1

# TransformerConfig fields of the run rather than the model (ModelParallelConfig's, except the dtypes, and these).
_KEPT_PARALLEL_FIELDS = ("bf16", "fp16", "params_dtype")
_RUN_PREFIXES = ("recompute_", "cpu_offloading", "fine_grained_activation_offloading", "offload_", "cuda_graph",
                 "enable_cuda_graph", "external_cuda_graph", "init_method", "output_layer_init_method",
                 "embedding_init_method", "perform_initialization", "use_cpu_initialization",
                 "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                 "pipeline_model_parallel_layout", "account_for_", "inference_")
_IMPORTABLE_ROOTS = ("torch", "megatron_core")


def _run_fields(config_class: type) -> set[str]:
    from megatron_core.model_parallel_config import ModelParallelConfig

    parallel = {f.name for f in dataclasses.fields(ModelParallelConfig)} - set(_KEPT_PARALLEL_FIELDS)
    run = {f.name for f in dataclasses.fields(config_class) if f.name.startswith(_RUN_PREFIXES)}
    marked = {f.name for f in dataclasses.fields(config_class) if {"ignored", "refused"} & set(f.metadata)}
    return parallel | run | marked


def _resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    if module.split(".")[0] not in _IMPORTABLE_ROOTS:
        raise ValueError(f"{path!r} is outside {_IMPORTABLE_ROOTS}; refusing to import it from a checkpoint")
    value: Any = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _encode(value: Any) -> Any:
    """A JSON value for ``value``; raises ``TypeError`` for what cannot be recorded faithfully."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else {"float": repr(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode(v) for k, v in value.items()}}
    if isinstance(value, enum.Enum):
        path = f"{type(value).__module__}:{type(value).__qualname__}"
        if _resolve(path)[value.name] is value:
            return {"enum": path, "name": value.name}
    if callable(value) and hasattr(value, "__qualname__") and "<" not in value.__qualname__:
        path = f"{value.__module__}:{value.__qualname__}"
        if _resolve(path) is value:
            return {"function": path}
    raise TypeError(f"cannot record {type(value).__name__} {value!r}")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "float" in value:
        return float(value["float"])
    if "dtype" in value:
        dtype = getattr(torch, value["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {value['dtype']!r}")
        return dtype
    if "tuple" in value:
        return tuple(_decode(v) for v in value["tuple"])
    if "dict" in value:
        return {k: _decode(v) for k, v in value["dict"].items()}
    if "enum" in value:
        return _resolve(value["enum"])[value["name"]]
    if "function" in value:
        return _resolve(value["function"])
    raise ValueError(f"unknown encoded value {value!r}")


def model_config_record(chunks: list[torch.nn.Module]) -> str | None:
    """The JSON record of the model whose chunks these are (``None`` for a model without a dataclass config).

    Every rank records the same string (nothing about pipeline stages or ranks enters it). A model with Mamba
    mixers also records their convolution width and SSD chunk size (``mamba_mixer``), which its layer spec sets.
    """
    chunk = innermost_module(chunks[0])
    config = getattr(chunk, "config", None)
    if config is None or not dataclasses.is_dataclass(config):
        return None
    model: dict[str, Any] = {}
    for attr in ("vocab_size", "max_sequence_length", "position_embedding_type", "share_embeddings_and_output_weights",
                 "parallel_output", "fp16_lm_cross_entropy", "hybrid_layer_pattern"):
        if hasattr(chunk, attr):
            model[attr] = getattr(chunk, attr)
    mixer = next((m for m in chunk.modules() if hasattr(m, "d_conv") and hasattr(m, "chunk_size")), None)
    if mixer is not None:
        model["mamba_mixer"] = {"d_conv": int(mixer.d_conv), "chunk_size": int(mixer.chunk_size)}
    rotary = getattr(chunk, "rotary_pos_emb", None)
    if rotary is not None and isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        model["rotary"] = {
            "class": type(rotary).__name__,
            "inv_freq": rotary.inv_freq.detach().float().cpu().tolist(),  # float32 values, exact in JSON
            "seq_len_interpolation_factor": getattr(rotary, "seq_len_interpolation_factor", None),
        }
    return model_config_record_for(config, type(chunk), model)


def model_config_record_for(config: Any, model_class: type, model: dict[str, Any]) -> str:
    """The JSON record of a ``model_class`` built from ``config`` with the model-level settings ``model``
    (``vocab_size``, ``max_sequence_length``, ...), without building it (e.g. for a converted checkpoint)."""
    skip = _run_fields(type(config))
    fields, unrecorded = {}, []
    for field in dataclasses.fields(config):
        if field.name in skip or not field.init:
            continue
        try:
            fields[field.name] = _encode(getattr(config, field.name))
        except (TypeError, ValueError, ImportError, AttributeError, KeyError):
            unrecorded.append(field.name)
    plain = ("rotary", "mamba_mixer")  # JSON already
    settings = {name: value if name in plain else _encode(value) for name, value in model.items()}
    record = {
        "format": FORMAT_VERSION,
        "model_class": f"{model_class.__module__}:{model_class.__qualname__}",
        "config_class": f"{type(config).__module__}:{type(config).__qualname__}",
        "transformer_config": fields,
        "unrecorded_fields": unrecorded,
        "model": settings,
    }
    return json.dumps(record, sort_keys=True)


def parse_model_config(text: str, where: str) -> dict[str, Any]:
    """The record saved by :func:`model_config_record`, checked; raises ``ValueError`` naming ``where``."""
    try:
        record = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: the recorded model_config is not JSON ({e})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT_VERSION:
        raise ValueError(f"{where}: model_config format {record.get('format') if isinstance(record, dict) else '?'} "
                         f"is not {FORMAT_VERSION}; this version of megatron_core cannot read it")
    for key in ("config_class", "transformer_config", "model"):
        if key not in record:
            raise ValueError(f"{where}: the recorded model_config lacks {key!r}")
    return record


def transformer_config_from_record(record: dict[str, Any], where: str, **overrides: Any) -> Any:
    """The recorded ``TransformerConfig`` (or subclass), with ``overrides`` (a reader's layout) applied."""
    try:
        config_class = _resolve(record["config_class"])
        kwargs = {name: _decode(value) for name, value in record["transformer_config"].items()}
    except (ValueError, ImportError, AttributeError, KeyError) as e:
        raise ValueError(f"{where}: cannot rebuild the recorded model config: {e}") from None
    known = {f.name for f in dataclasses.fields(config_class) if f.init}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"{where}: the recorded config has fields this version of {config_class.__name__} lacks: "
                         f"{unknown[:10]}")
    return config_class(**{**kwargs, **overrides})
