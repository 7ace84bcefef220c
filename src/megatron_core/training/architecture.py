"""The model's architecture recorded in a checkpoint and compared on load.

Shapes alone do not catch every mismatch: a different head count at the same hidden size gives
the same ``linear_qkv`` shape, and embeddings allow a vocabulary-size mismatch (padding). So
``save_checkpoint`` records, under ``model_architecture`` in the common state, the
``TransformerConfig`` fields that shape weights, the model's vocabulary size, position-embedding
type and tied-embedding flag, and the layer spec (the class of every submodule of each decoder
layer, by global layer number). ``load_checkpoint`` compares them and raises naming the field,
the checkpoint's value and the current one.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megatron_core._wrapped_model import innermost_module
from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.core import CheckpointingException

ARCHITECTURE_KEY = "model_architecture"

# TransformerConfig fields that decide the shape or meaning of the weights.
CONFIG_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size",
    "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "normalization", "qk_layernorm",
    "layernorm_zero_centered_gamma", "num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "multi_latent_attention", "mtp_num_layers", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
    "v_head_dim", "moe_latent_size", "softmax_type",
)
MODEL_ATTRS = ("vocab_size", "position_embedding_type", "share_embeddings_and_output_weights")


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def _layer_specs(chunk: torch.nn.Module) -> dict[int, dict[str, str]]:
    decoder = getattr(chunk, "decoder", None)
    layers = getattr(decoder, "layers", None) or []
    specs = {}
    for layer in layers:
        number = getattr(layer, "layer_number", None)
        if isinstance(number, int):
            specs[number] = {name: type(m).__name__ for name, m in layer.named_modules() if name}
    return specs


def model_architecture(chunks: list[torch.nn.Module], group: Any = None) -> dict[str, Any] | None:
    """The architecture of the model (all ranks' chunks); ``None`` for a model without a config. Collective."""
    chunks = [innermost_module(chunk) for chunk in chunks]
    config = getattr(chunks[0], "config", None)
    local_specs: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        local_specs.update(_layer_specs(chunk))
    specs: dict[int, dict[str, str]] = {}
    for part in collectives.all_gather_object(local_specs, group):
        specs.update(part)
    if config is None:
        return None
    arch: dict[str, Any] = {f: _plain(getattr(config, f)) for f in CONFIG_FIELDS if hasattr(config, f)}
    for attr in MODEL_ATTRS:
        if hasattr(chunks[0], attr):
            arch[attr] = _plain(getattr(chunks[0], attr))
    if arch.get("position_embedding_type") == "learned_absolute" and hasattr(chunks[0], "max_sequence_length"):
        arch["max_sequence_length"] = _plain(chunks[0].max_sequence_length)
    arch["layer_spec"] = {str(k): v for k, v in sorted(specs.items())}
    return arch


def _without_local_experts(spec: dict[str, str]) -> dict[str, str]:
    return {name: kind for name, kind in spec.items() if re.search(r"(^|\.)local_experts\.\d+", name) is None}


def check_architecture(saved: dict[str, Any] | None, chunks: list[torch.nn.Module], checkpoint_dir: Any) -> None:
    """Raise ``CheckpointingException`` at the first field where the checkpoint and the model differ."""
    if not saved:
        return
    chunks = [innermost_module(chunk) for chunk in chunks]
    config = getattr(chunks[0], "config", None)
    if config is None:
        return
    current: dict[str, Any] = {f: _plain(getattr(config, f)) for f in CONFIG_FIELDS if hasattr(config, f)}
    for attr in MODEL_ATTRS + ("max_sequence_length",):
        if hasattr(chunks[0], attr):
            current[attr] = _plain(getattr(chunks[0], attr))
    for field, value in saved.items():
        if field == "layer_spec" or field not in current:
            continue
        if field == "max_sequence_length" and current.get("position_embedding_type") != "learned_absolute":
            continue
        if current[field] != value:
            raise CheckpointingException(
                f"{checkpoint_dir} was saved from another architecture: {field} is {value!r} in the checkpoint "
                f"and {current[field]!r} in the current model")
    saved_specs = saved.get("layer_spec") or {}
    for chunk in chunks:
        for number, spec in _layer_specs(chunk).items():
            old = saved_specs.get(str(number))
            if old is not None:  # how many routed experts a rank holds depends on expert parallelism
                old, spec = _without_local_experts(old), _without_local_experts(spec)
            if old is None or old == spec:
                continue
            for name in sorted(set(old) | set(spec)):
                if old.get(name) != spec.get(name):
                    raise CheckpointingException(
                        f"{checkpoint_dir} was saved from another layer spec: decoder layer {number} submodule "
                        f"{name!r} is {old.get(name)} in the checkpoint and {spec.get(name)} in the current model")
