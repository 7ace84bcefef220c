"""Minitron width and depth pruning of a GPTModel (Megatron-LM's ``mtp.prune(model, mode="mcore_minitron", ...)``).

Megatron-LM prunes with Model Optimizer's ``mcore_minitron`` mode, whose dynamic modules are written for
NVIDIA's ``megatron.core`` and Transformer Engine classes (importing them needs both). This module implements
the same algorithm for this library's ``GPTModel`` without Model Optimizer: :func:`prune` takes the arguments
of ``mtp.prune``, estimates importance on the calibration ``forward_loop`` (:mod:`.pruning_importance`), keeps
the most important embedding channels, FFN neurons, query groups, heads within each kept group and layers, and
rebuilds the model's embedding, decoder and output layer at the ``export_config`` sizes (``TransformerConfig``
updated, parameters sliced, not masked). The model is changed in place and stays a plain ``GPTModel``: it
trains, saves and loads through ``dist_checkpointing`` like any other, and :func:`pruned_hf_bridge` gives the
Hugging Face bridge that exports it.

Kept channels and heads stay in their original order (Model Optimizer sorts them by importance first; the
function is the same). Tensor, pipeline and context parallelism, MoE, multi-latent attention, multi-token
prediction and heterogeneous layers are refused with a ``ValueError``; data parallelism is supported (the scores
are summed over the data-parallel group, so every replica prunes alike).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

import torch

from megatron_core._ground.groups import get_pg_size
from megatron_core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron_core.post_training.modelopt.pruning_importance import MinitronImportance, estimate_importance
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.transformer.transformer_block import TransformerBlock

__all__ = ["SUPPORTED_HPARAMS", "check_export_config", "drop_mcore_language_model_layers", "prune",
           "prune_to_export_config", "pruned_hf_bridge"]

SUPPORTED_HPARAMS = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "num_layers")

_UNSUPPORTED_FEATURES = (
    ("num_moe_experts", "MoE layers (Model Optimizer's expert pruning is not implemented here)"),
    ("multi_latent_attention", "multi-latent attention"),
    ("mtp_num_layers", "multi-token prediction layers"),
    ("heterogeneous_block_specs", "heterogeneous (per-layer) block specs"),
    ("attention_output_gate", "gated attention output (its gate rows in linear_qkv are not ranked)"),
    ("experimental_attention_variant", "gated delta net / experimental attention layers"),
)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _check_model(model: torch.nn.Module) -> None:
    """``ValueError`` naming what this pruning does not handle."""
    from megatron_core.models.gpt import GPTModel

    if not isinstance(model, GPTModel):
        raise ValueError(f"Minitron pruning here takes a GPTModel, got {type(model).__name__} (hybrid/Mamba models "
                         "are not supported)")
    config = model.config
    for field, what in _UNSUPPORTED_FEATURES:
        if getattr(config, field, None):
            raise ValueError(f"Minitron pruning does not support {what}: config.{field} is {getattr(config, field)!r}")
    for role, name in (("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"),
                       ("cp", "context_parallel_size")):
        size = get_pg_size(resolve_process_group(role, model.pg_collection))
        if size != 1:
            raise ValueError(f"Minitron pruning needs {name} 1 (got {size}): it ranks and slices whole weights; "
                             "save the model and load it at 1 first")
    for i, layer in enumerate(model.decoder.layers):
        for norm in ("input_layernorm", "pre_mlp_layernorm"):
            if type(getattr(layer, norm)).__name__ in ("IdentityOp", "IdentityFuncOp"):
                raise ValueError(f"decoder.layers.{i}.{norm} is an IdentityOp (a norm fused into the next linear): "
                                 "Minitron needs separate norm modules (the local or Model Optimizer GPT spec)")
    if any(name.endswith("_quantizer") for name, _ in model.named_modules()):
        raise ValueError("the model is quantized (Model Optimizer quantizers found): prune before quantizing")


def check_export_config(config: Any, export_config: dict[str, int]) -> dict[str, int]:
    """All five target sizes for ``config`` (given ones checked, the rest kept); ``ValueError`` naming the rule.

    Without ``num_query_groups`` a GQA model keeps its query groups (heads are pruned within them, as Model
    Optimizer does) and a multi-head model keeps one head per group.
    """
    unknown = sorted(set(export_config) - set(SUPPORTED_HPARAMS))
    if unknown:
        raise ValueError(f"export_config has unknown key(s) {unknown}; supported: {list(SUPPORTED_HPARAMS)}")
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    current = {"hidden_size": config.hidden_size, "ffn_hidden_size": config.ffn_hidden_size,
               "num_attention_heads": heads, "num_query_groups": groups, "num_layers": config.num_layers}
    for key, value in export_config.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"export_config[{key!r}] ({value!r}) must be a positive integer")
        if value > current[key]:
            raise ValueError(f"export_config[{key!r}] ({value}) must not exceed the model's {key} ({current[key]}): "
                             "pruning only removes")
    target = {**current, **export_config}
    if "num_query_groups" not in export_config and groups == heads:
        target["num_query_groups"] = target["num_attention_heads"]
    new_heads, new_groups = target["num_attention_heads"], target["num_query_groups"]
    if new_heads % new_groups:
        raise ValueError(f"export_config: num_attention_heads ({new_heads}) must be divisible by num_query_groups "
                         f"({new_groups})")
    if new_heads // new_groups > heads // groups:
        raise ValueError(f"export_config: num_attention_heads / num_query_groups ({new_heads} / {new_groups}) must not "
                         f"exceed the model's heads per query group ({heads} / {groups}): heads are kept within "
                         "their groups")
    return target


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest scores, in ascending index order (ties: the lower index wins)."""
    return torch.argsort(scores.cpu(), descending=True, stable=True)[:k].sort().values


def _attention_indices(config: Any, head_scores: torch.Tensor, group_scores: torch.Tensor, target: dict[str, int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear_qkv rows, linear_proj columns)`` to keep: the best groups, the best heads within each."""
    hn, groups = config.kv_channels, config.num_query_groups or config.num_attention_heads
    per_group = config.num_attention_heads // groups
    new_per_group = target["num_attention_heads"] // target["num_query_groups"]
    qkv_rows, proj_cols = [], []
    for g in _top(group_scores, target["num_query_groups"]).tolist():
        heads = _top(head_scores[g * per_group:(g + 1) * per_group], new_per_group).tolist()
        start = g * (per_group + 2) * hn  # group g's rows: its query heads, then its key, then its value
        for h in heads:
            qkv_rows.append(torch.arange(start + h * hn, start + (h + 1) * hn))
            proj_cols.append(torch.arange((g * per_group + h) * hn, (g * per_group + h + 1) * hn))
        qkv_rows.append(torch.arange(start + per_group * hn, start + (per_group + 2) * hn))
    return torch.cat(qkv_rows), torch.cat(proj_cols)


def _layer_rules(config: Any, importance: MinitronImportance, old: int, hidden: torch.Tensor,
                 target: dict[str, int]) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """(rows, columns) to keep of each parameter of old layer ``old``, by its name within the layer."""
    qkv_rows, proj_cols = _attention_indices(config, importance.heads[old], importance.query_groups[old], target)
    ffn = _top(importance.ffn[old], target["ffn_hidden_size"])
    fc1_rows = torch.cat([ffn, ffn + config.ffn_hidden_size]) if config.gated_linear_unit else ffn
    rules = {"self_attention.linear_qkv.weight": (qkv_rows, hidden), "self_attention.linear_qkv.bias": (qkv_rows, None),
             "self_attention.linear_proj.weight": (hidden, proj_cols),
             "mlp.linear_fc1.weight": (fc1_rows, hidden), "mlp.linear_fc1.bias": (fc1_rows, None),
             "mlp.linear_fc2.weight": (hidden, ffn)}
    for name in ("self_attention.linear_proj.bias", "mlp.linear_fc2.bias", "input_layernorm.weight",
                 "input_layernorm.bias", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                 "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
                 "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias"):
        rules[name] = (hidden, None)
    return rules


_GLOBAL_HIDDEN_COLUMNS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                          "output_layer.weight")
_LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def _sliced(old_state: dict[str, Any], new_state: dict[str, Any], kept_layers: list[int], config: Any,
            importance: MinitronImportance, hidden: torch.Tensor, target: dict[str, int]) -> dict[str, Any]:
    """The new model's state dict filled from the old one's kept layers, rows and columns."""
    layer_rules = {old: _layer_rules(config, importance, old, hidden, target) for old in kept_layers}
    out = {}
    for key, like in new_state.items():
        rows, cols, source = None, None, key
        match = _LAYER_KEY.fullmatch(key)
        if match:
            old = kept_layers[int(match.group(1))]
            source = f"decoder.layers.{old}.{match.group(2)}"
            rows, cols = layer_rules[old].get(match.group(2), (None, None))
        elif key in _GLOBAL_HIDDEN_COLUMNS:
            cols = hidden
        elif key in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
            rows = hidden
        value = old_state[source]
        if isinstance(value, torch.Tensor):
            if rows is not None:
                value = value.index_select(0, rows.to(value.device))
            if cols is not None:
                value = value.index_select(1, cols.to(value.device))
            if isinstance(like, torch.Tensor) and value.shape != like.shape:
                raise ValueError(f"Minitron pruning does not know how to slice {source} (shape "
                                 f"{tuple(old_state[source].shape)}) to the pruned shape {tuple(like.shape)}")
        out[key] = value
    return out


def _rebuild(model: torch.nn.Module, config: Any) -> None:
    """Replace the model's embedding, decoder and output layer by fresh ones of ``config`` (same kinds, groups).

    They are moved to the device and floating dtype of the old parameters (a model cast after it was built, e.g.
    by ``Float16Module``, keeps its dtype)."""
    first = next(model.parameters())
    model.config = config
    if model.pre_process:
        old = model.embedding
        model.embedding = LanguageModelEmbedding(
            config=config, vocab_size=model.vocab_size, max_sequence_length=model.max_sequence_length,
            position_embedding_type=model.position_embedding_type,
            scatter_to_sequence_parallel=old.scatter_to_sequence_parallel, tp_group=model.tp_group)
    model.decoder = TransformerBlock(config=config, spec=model.transformer_layer_spec, pre_process=model.pre_process,
                                     post_process=model.post_process, pg_collection=model.pg_collection,
                                     vp_stage=model.vp_stage)
    if model.post_process:
        model.output_layer = model.build_output_layer(
            model.vocab_size, model.parallel_output,
            skip_weight_param_allocation=model.pre_process and model.share_embeddings_and_output_weights)
    model.setup_embeddings_and_output_layer()
    model.to(device=first.device, dtype=first.dtype)


def prune_to_export_config(model: torch.nn.Module, export_config: dict[str, int],
                           importance: MinitronImportance) -> torch.nn.Module:
    """Prune ``model`` in place to ``export_config`` by ``importance`` (of this model); returns the model.

    Depth first: the ``num_layers - export_config["num_layers"]`` layers of the lowest Block Importance go; then
    the kept layers, the embeddings, the final norm and the output layer are sliced to the kept channels.
    """
    model = _unwrap(model)
    _check_model(model)
    config = model.config
    target = check_export_config(config, export_config)
    kept_layers = _top(importance.layers, target["num_layers"]).tolist()
    hidden = _top(importance.hidden, target["hidden_size"])
    old_state = model.state_dict()
    old_parts = {name: getattr(model, name) for name in ("embedding", "decoder", "output_layer") if hasattr(model, name)}
    _rebuild(model, dataclasses.replace(config, **target))
    try:
        model.load_state_dict(_sliced(old_state, model.state_dict(), kept_layers, config, importance, hidden, target))
    except Exception:
        for name, part in old_parts.items():  # leave the model as it was
            setattr(model, name, part)
        model.config = config
        raise
    return model


def drop_mcore_language_model_layers(model: torch.nn.Module, *, layers_to_drop: list[int]) -> torch.nn.Module:
    """Remove the given layers (numbered from 1, as Model Optimizer's function of this name) in place."""
    model = _unwrap(model)
    _check_model(model)
    n = model.config.num_layers
    bad = sorted({x for x in layers_to_drop if not isinstance(x, int) or not 1 <= x <= n})
    if bad or len(set(layers_to_drop)) >= n:
        raise ValueError(f"layers_to_drop {sorted(layers_to_drop)} must name distinct layers in 1..{n} and leave at "
                         f"least one (out of range: {bad})")
    scores = torch.ones(n)
    scores[[x - 1 for x in layers_to_drop]] = 0.0
    config = model.config
    width = MinitronImportance(
        hidden=torch.ones(config.hidden_size), ffn=[torch.ones(config.ffn_hidden_size)] * n,
        heads=[torch.ones(config.num_attention_heads)] * n,
        query_groups=[torch.ones(config.num_query_groups or config.num_attention_heads)] * n, layers=scores)
    return prune_to_export_config(model, {"num_layers": n - len(set(layers_to_drop))}, width)


def _load_or_estimate(model: torch.nn.Module, forward_loop: Callable | None, checkpoint: str | None
                      ) -> MinitronImportance:
    """Scores from ``checkpoint`` (a file an earlier run wrote) if it exists, else estimated (and written there)."""
    if checkpoint is not None and os.path.isfile(checkpoint):
        return MinitronImportance(**torch.load(checkpoint, weights_only=True))
    if forward_loop is None:
        raise ValueError("prune: config['forward_loop'] is required (a callable running calibration batches through "
                         "the model) unless config['checkpoint'] names saved scores")
    importance = estimate_importance(model, forward_loop)
    if checkpoint is not None and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        os.makedirs(os.path.dirname(os.path.abspath(checkpoint)), exist_ok=True)
        torch.save(importance.state_dict(), checkpoint)
    return importance


def prune(model: torch.nn.Module, mode: str, constraints: dict[str, Any], dummy_input: Any = None,
          config: dict[str, Any] | None = None) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Minitron-prune ``model`` in place, with ``mtp.prune``'s arguments; returns ``(model, {"importance": ...})``.

    ``mode`` must be ``"mcore_minitron"``; ``constraints`` ``{"export_config": {...}}`` with keys from
    :data:`SUPPORTED_HPARAMS`; ``dummy_input`` is unused (as in Megatron-LM); ``config`` holds ``forward_loop``
    (``forward_loop(model)`` runs the calibration batches) and optionally ``checkpoint``, a file for the scores:
    read when it exists (pruning the same model to another size needs no calibration), written otherwise;
    ``verbose`` (a key Megatron-LM may pass) is accepted and ignored.
    """
    if mode != "mcore_minitron":
        raise ValueError(f"prune: mode {mode!r} is not supported; use 'mcore_minitron'")
    if set(constraints) != {"export_config"}:
        raise ValueError(f"prune: constraints must be {{'export_config': {{...}}}} (got keys {sorted(constraints)}); "
                         "params/flops search is not supported")
    options = dict(config or {})
    unknown = sorted(set(options) - {"forward_loop", "checkpoint", "verbose"})
    if unknown:
        raise ValueError(f"prune: unknown config key(s) {unknown}; supported: forward_loop, checkpoint, verbose")
    del dummy_input
    model = _unwrap(model)
    _check_model(model)
    export_config = dict(constraints["export_config"])
    check_export_config(model.config, export_config)
    importance = _load_or_estimate(model, options.get("forward_loop"), options.get("checkpoint"))
    prune_to_export_config(model, export_config, importance)
    return model, {"importance": importance, "export_config": export_config}


def pruned_hf_bridge(bridge: Any, model: torch.nn.Module) -> Any:
    """An ``AutoBridge`` like ``bridge`` (a Llama-like family) whose config.json has the pruned ``model``'s sizes.

    ``head_dim`` is written explicitly, since pruning changes ``hidden_size / num_attention_heads``.
    ``bridge.save_hf_pretrained(model, path)`` on the result exports the pruned model.
    """
    from megatron_core.models.hf import AutoBridge
    from megatron_core.models.hf.families import family_from_config

    config = _unwrap(model).config
    hf_config = dict(bridge.hf_config)
    needed = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
    missing = [key for key in needed if key not in hf_config]
    if missing:
        raise ValueError(f"pruned_hf_bridge: the {bridge.architecture} config has no {missing} (only Llama-like "
                         "configs with an explicit head_dim can describe a pruned model)")
    hf_config.update(hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
                     num_attention_heads=config.num_attention_heads,
                     num_key_value_heads=config.num_query_groups or config.num_attention_heads,
                     num_hidden_layers=config.num_layers, head_dim=config.kv_channels)
    return AutoBridge(bridge.directory, hf_config, family_from_config(hf_config, "pruned config.json"), None)
