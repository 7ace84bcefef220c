"""What the HF bridge sees of a Megatron model: its mappable parameters, their global shapes, the TP/EP
ranks that hold them, and the tokenizer files that travel with a checkpoint.

Shared by :mod:`.bridge` (load) and :mod:`.export` (save); ``bridge`` re-exports these names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size, unwrap_model
from megatron_core.models.hf.families import (
    Family,
)
from megatron_core.models.hf.rules import WeightRule
from megatron_core.models.hf.safetensors_io import HFConversionError
from megatron_core.process_groups_config import resolve_process_group

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GROUPED_EXPERTS = re.compile(
    r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.mtp_model_layer)\.mlp\.experts)\.(linear_fc[12]\.(?:weight|bias))$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_GDN = re.compile(r"\.self_attention\.(in_proj\.weight|conv1d\.weight|A_log|dt_bias|out_norm\.weight|out_proj\.weight)$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (:func:`megatron_core.utils.unwrap_model`)."""
    model = unwrap_model(model)
    if not hasattr(model, "decoder"):
        raise TypeError(f"{type(model).__name__} is not a GPTModel (or a wrapper of one)")
    return model


def hf_mappable_parameters(model: torch.nn.Module, buffers: tuple[str, ...] = ()
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.named_parameters()`` with each grouped-expert parameter (``TEGroupedMLP``'s ``[E, ...]`` weights)
    given as one view per local expert, under the ``SequentialMLP`` name the conversion rules know
    (``...mlp.experts.local_experts.<e>.linear_fc1.weight``): both expert layouts convert alike. Then the
    persistent buffers whose names end with one of ``buffers`` (e.g. the router's ``expert_bias``)."""
    for name, param in model.named_parameters():
        grouped = _GROUPED_EXPERTS.match(name)
        if grouped is None:
            yield name, param
            continue
        for e in range(param.shape[0]):
            yield f"{grouped.group(1)}.local_experts.{e}.{grouped.group(2)}", param[e]
    if buffers:
        for name, buffer in model.named_buffers():
            if name.endswith(buffers):
                yield name, buffer


def group_rank_size(role: str, pg_collection: Any = None) -> tuple[int, int, Any]:
    """``(rank, size, group)`` of ``role``'s group from the package's one resolver (``pg_collection`` when given,
    else ``parallel_state``); no group means one rank."""
    group = resolve_process_group(role, pg_collection)
    return get_pg_rank(group), get_pg_size(group), group


def tp_rank_size(pg_collection: Any = None) -> tuple[int, int, Any]:
    """``(rank, size, group)`` of tensor parallelism: ``pg_collection.tp``, else ``parallel_state``, else one rank."""
    return group_rank_size("tp", pg_collection)


def is_expert_rule(rule: WeightRule) -> bool:
    """Whether ``rule`` is a routed expert's weight (split over expert-TP, placed by expert parallelism)."""
    return "local_experts" in rule.mcore


def expert_tp_rank_size(pg_collection: Any = None) -> tuple[int, int, Any]:
    """``(rank, size, group)`` of expert tensor parallelism: ``pg_collection.expt_tp``, else ``parallel_state``."""
    return group_rank_size("expt_tp", pg_collection)


def expert_ep_rank(pg_collection: Any = None) -> int:
    """This rank's expert-parallel rank: ``pg_collection.ep``, else ``parallel_state``'s (0 without one)."""
    return group_rank_size("ep", pg_collection)[0]


def mcore_shape(name: str, family: Family, vocab: int) -> tuple[int, ...]:
    """The full (TP=1) shape of GPTModel parameter ``name`` (layer index replaced by ``{i}``) for ``family``."""
    c = family.config_kwargs
    hidden, hd = c["hidden_size"], c.get("kv_channels") or c["hidden_size"] // c["num_attention_heads"]
    heads, groups = c["num_attention_heads"], c.get("num_query_groups") or c["num_attention_heads"]
    ffn = c["ffn_hidden_size"]
    if c.get("multi_latent_attention") and ".self_attention." in name:
        return _mla_shape(name, c)
    if ".mixer." in name:
        return _mamba_shape(name, c, family.mixer_params["d_conv"])
    if c.get("experimental_attention_variant") == "gated_delta_net" and _GDN.search(name):
        return _gdn_shape(name, c)
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return (vocab, hidden)
    if name.endswith("eh_proj.weight"):
        return (hidden, 2 * hidden)
    if name.endswith("position_embeddings.weight"):
        return (family.model_kwargs["max_sequence_length"], hidden)
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return (hd,)
    if name.endswith("mlp.router.weight"):
        return (c["num_moe_experts"], hidden)
    if name.endswith(("mlp.router.bias", "mlp.router.expert_bias")):
        return (c["num_moe_experts"],)
    if name.endswith("core_attention.softmax_offset"):
        return (heads,)
    if name.endswith("shared_experts.gate_weight"):
        return (1, hidden)
    if "local_experts" in name:
        ffn = c["moe_ffn_hidden_size"]
    elif "shared_experts" in name:
        ffn = c["moe_shared_expert_intermediate_size"]
    if "linear_qkv" in name:
        rows = (heads * (2 if c.get("attention_output_gate") else 1) + 2 * groups) * hd
        return (rows, hidden) if name.endswith("weight") else (rows,)
    if "linear_proj" in name:
        return (hidden, heads * hd) if name.endswith("weight") else (hidden,)
    if "linear_fc1" in name:
        rows = ffn * (2 if c.get("gated_linear_unit") else 1)
        return (rows, hidden) if name.endswith("weight") else (rows,)
    if "linear_fc2" in name:
        return (hidden, ffn) if name.endswith("weight") else (hidden,)
    return (hidden,)


def _mamba_shape(name: str, c: dict[str, Any], d_conv: int) -> tuple[int, ...]:
    """Full shapes of a Mamba mixer's parameters (``mamba_*`` TransformerConfig fields in ``c``)."""
    heads, d_inner = c["mamba_num_heads"], c["mamba_num_heads"] * c["mamba_head_dim"]
    conv = d_inner + 2 * c["mamba_num_groups"] * c["mamba_state_dim"]
    shapes = {
        "in_proj.weight": (d_inner + conv + heads, c["hidden_size"]),
        "conv1d_weight": (conv, 1, d_conv),
        "conv1d_bias": (conv,),
        "dt_bias": (heads,), "A_log": (heads,), "D": (heads,),
        "norm.weight": (d_inner,),
        "out_proj.weight": (c["hidden_size"], d_inner),
    }
    suffix = name.split(".mixer.", 1)[1]
    if suffix not in shapes:
        raise HFConversionError(f"{name}: no shape known for this Mamba mixer parameter")
    return shapes[suffix]


def _gdn_shape(name: str, c: dict[str, Any]) -> tuple[int, ...]:
    """Full shapes of a gated delta net's parameters (the ``linear_*`` TransformerConfig fields in ``c``)."""
    qk = c["linear_key_head_dim"] * c["linear_num_key_heads"]
    v, heads = c["linear_value_head_dim"] * c["linear_num_value_heads"], c["linear_num_value_heads"]
    shapes = {
        "in_proj.weight": (2 * qk + 2 * v + 2 * heads, c["hidden_size"]),
        "conv1d.weight": (2 * qk + v, 1, c["linear_conv_kernel_dim"]),
        "A_log": (heads,), "dt_bias": (heads,),
        "out_norm.weight": (c["linear_value_head_dim"],),
        "out_proj.weight": (c["hidden_size"], v),
    }
    return shapes[_GDN.search(name).group(1)]


def _mla_shape(name: str, c: dict[str, Any]) -> tuple[int, ...]:
    """Full shapes of multi-latent attention's parameters (``MLATransformerConfig`` fields in ``c``)."""
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    rope, v = c["qk_pos_emb_head_dim"], c["v_head_dim"]
    shapes = {
        "linear_q_down_proj.weight": (c["q_lora_rank"], hidden),
        "linear_q_up_proj.weight": (heads * (c["qk_head_dim"] + rope), c["q_lora_rank"]),
        "linear_q_proj.weight": (heads * (c["qk_head_dim"] + rope), hidden),
        "linear_kv_down_proj.weight": (c["kv_lora_rank"] + rope, hidden),
        "linear_kv_up_proj.weight": (heads * (c["qk_head_dim"] + v), c["kv_lora_rank"]),
        "q_layernorm.weight": (c["q_lora_rank"],),
        "kv_layernorm.weight": (c["kv_lora_rank"],),
        "linear_proj.weight": (hidden, heads * v),
        "linear_proj.bias": (hidden,),
    }
    if c.get("experimental_attention_variant") == "dsa":  # DeepSeek sparse attention's indexer
        n, d, indexer = c["dsa_indexer_n_heads"], c["dsa_indexer_head_dim"], "core_attention.indexer."
        shapes.update({indexer + "linear_wq_b.weight": (n * d, c["q_lora_rank"]),
                       indexer + "linear_wk.weight": (d, hidden), indexer + "k_norm.weight": (d,),
                       indexer + "k_norm.bias": (d,), indexer + "linear_weights_proj.weight": (n, hidden)})
    suffix = name.split(".self_attention.", 1)[1]
    if suffix not in shapes:
        raise HFConversionError(f"{name}: no shape known for this multi-latent attention parameter")
    return shapes[suffix]
