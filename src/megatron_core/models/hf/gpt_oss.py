"""The GPT-OSS family (``GptOssForCausalLM``): config mapping and weight rules.

GPT-OSS is a MoE decoder with every linear biased, per-head attention sinks, sliding-window attention on
the layers ``layer_types`` marks ``sliding_attention``, YaRN RoPE, and experts whose gated activation is
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``. In Megatron-Core
terms: ``add_bias_linear``, ``softmax_type='learnable'`` (``core_attention.softmax_offset`` = ``sinks``),
``window_size=(W - 1, 0)`` with ``window_attn_skip_freq`` per layer, ``position_embedding_type='yarn'`` with
the ``yarn_*`` fields, ``activation_func=quick_gelu`` (``alpha`` must be its 1.702),
``glu_linear_offset=1`` and ``activation_func_clamp_value=limit``; the router is a biased linear followed by
top-k and a softmax over the chosen logits (``moe_router_pre_softmax=False``).

Experts are stored stacked (see :mod:`.stacked_rules`); ``gate_up_proj`` interleaves gate and up columns,
which become Megatron's ``[gate; up]`` fc1 rows. Checkpoints quantized to MXFP4 (``*_blocks`` / ``*_scales``)
are not read: dequantize them first (transformers does when it loads one).
"""

from __future__ import annotations

import math
from typing import Any

from megatron_core.activations import quick_gelu
from megatron_core.models.hf.rules import Copy, FusedQKV, WeightRule
from megatron_core.models.hf.safetensors_io import HFConversionError
from megatron_core.models.hf.stacked_rules import StackedExpertCopy, StackedInterleavedGateUp

__all__ = ["gpt_oss_config_kwargs", "gpt_oss_rules"]

_LAYER_TYPES = ("sliding_attention", "full_attention")


def _get(cfg: dict, name: str, default: Any = None) -> Any:
    return cfg[name] if cfg.get(name) is not None else default


def _reject(path: str, cfg: dict, name: str, bad: bool, why: str) -> None:
    if bad:
        raise HFConversionError(f"{path}: {name}={cfg.get(name)!r} is not supported ({why})")


def _rope_fields(path: str, cfg: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(TransformerConfig yarn_* fields, GPTModel arguments)`` from ``rope_parameters`` / ``rope_scaling``."""
    params = {**dict(cfg.get("rope_scaling") or {}), **dict(cfg.get("rope_parameters") or {})}
    theta = float(_get(params, "rope_theta", _get(cfg, "rope_theta", 150000.0)))
    _reject(path, params, "partial_rotary_factor", float(_get(params, "partial_rotary_factor", 1.0)) != 1.0,
            "YaRN here rotates every channel")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return {}, dict(position_embedding_type="rope", rotary_base=theta)
    if kind != "yarn":
        raise HFConversionError(f"{path}: RoPE type {kind!r} is not supported for GPT-OSS (only 'yarn' and 'default')")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(cfg["max_position_embeddings"]) / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # Hugging Face then uses 0.1 * ln(factor) + 1 alone
        mscale, mscale_all_dim = 1.0, 0.0
    attention_factor = params.get("attention_factor")
    if attention_factor is not None:  # an explicit factor A: 0.1 * m * ln(f) + 1 = A with mscale_all_dim 0
        if factor <= 1:
            _reject(path, params, "attention_factor", float(attention_factor) != 1.0, "needs factor > 1")
        else:
            mscale, mscale_all_dim = (float(attention_factor) - 1.0) / (0.1 * math.log(factor)), 0.0
    fields = dict(
        yarn_rotary_scaling_factor=factor, yarn_original_max_position_embeddings=original,
        yarn_beta_fast=float(params.get("beta_fast") or 32.0), yarn_beta_slow=float(params.get("beta_slow") or 1.0),
        yarn_mscale=float(mscale), yarn_mscale_all_dim=float(mscale_all_dim),
        yarn_correction_range_round_to_int=bool(params.get("truncate", True)),
    )
    return fields, dict(position_embedding_type="yarn", rotary_base=theta)


def _window_fields(path: str, cfg: dict, layers: int) -> dict[str, Any]:
    """``window_size`` and ``window_attn_skip_freq`` from ``sliding_window`` and ``layer_types``."""
    types = list(cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                            for i in range(layers)])
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    _reject(path, cfg, "layer_types", bool(unknown) or len(types) != layers,
            f"one of {list(_LAYER_TYPES)} per layer")
    window = cfg.get("sliding_window")
    sliding = [int(t == "sliding_attention") for t in types]
    if not window or not any(sliding):
        return {}
    # HF sees a key while q - k < W: Megatron's window_size (W - 1, 0).
    fields: dict[str, Any] = dict(window_size=(int(window) - 1, 0))
    if not all(sliding):
        alternating = all(s == int((i + 1) % 2 != 0) for i, s in enumerate(sliding))
        fields["window_attn_skip_freq"] = 2 if alternating else sliding
    return fields


def gpt_oss_config_kwargs(path: str, cfg: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(TransformerConfig fields, GPTModel arguments)`` of a ``GptOssForCausalLM`` config."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    alpha, limit = float(_get(cfg, "swiglu_alpha", 1.702)), _get(cfg, "swiglu_limit", 7.0)
    _reject(path, cfg, "swiglu_alpha", not math.isclose(alpha, 1.702, rel_tol=0, abs_tol=1e-9),
            "quick_gelu's gain is 1.702")
    _reject(path, cfg, "attention_bias", cfg.get("attention_bias") is False,
            "GPT-OSS's experts and router are biased, so every linear is (add_bias_linear)")
    _reject(path, cfg, "quantization_config", cfg.get("quantization_config") is not None,
            "quantized (MXFP4) experts: load the model with transformers, which dequantizes it, and save_pretrained")
    yarn, model_kwargs = _rope_fields(path, cfg)
    config = dict(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=int(_get(cfg, "num_key_value_heads", heads)),
        kv_channels=int(_get(cfg, "head_dim", hidden // heads)), ffn_hidden_size=int(cfg["intermediate_size"]),
        normalization="RMSNorm", layernorm_epsilon=float(_get(cfg, "rms_norm_eps", 1e-5)),
        add_bias_linear=True, gated_linear_unit=True, activation_func=quick_gelu, glu_linear_offset=1.0,
        activation_func_clamp_value=float(limit) if limit is not None else None, softmax_type="learnable",
        hidden_dropout=0.0, attention_dropout=float(cfg.get("attention_dropout") or 0.0),
        num_moe_experts=int(cfg["num_local_experts"]), moe_router_topk=int(cfg["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(cfg["intermediate_size"]), moe_router_pre_softmax=False,
        **_window_fields(path, cfg, layers), **yarn,
    )
    model_kwargs.update(share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
                        max_sequence_length=int(_get(cfg, "max_position_embeddings", 4096)))
    return config, model_kwargs


def gpt_oss_rules(config: dict[str, Any], tied: bool) -> tuple[list[WeightRule], list[WeightRule]]:
    """``(layer rules, global rules)`` of GPT-OSS's tensor names."""
    heads, groups, head_dim = config["num_attention_heads"], config["num_query_groups"], config["kv_channels"]
    experts = config["num_moe_experts"]
    qkv = dict(num_heads=heads, num_groups=groups, head_dim=head_dim)
    a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    expert = "decoder.layers.{i}.mlp.experts.local_experts.{e}."
    stacked = dict(num_experts=experts)
    layer_rules: list[WeightRule] = [
        Copy("decoder.layers.{i}.input_layernorm.weight", hf="model.layers.{i}.input_layernorm.weight"),
        FusedQKV("decoder.layers.{i}.self_attention.linear_qkv.weight",
                 parts=(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), **qkv),
        FusedQKV("decoder.layers.{i}.self_attention.linear_qkv.bias",
                 parts=(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), **qkv),
        Copy("decoder.layers.{i}.self_attention.core_attention.softmax_offset", hf=a + "sinks", tp_axis=0),
        Copy("decoder.layers.{i}.self_attention.linear_proj.weight", hf=a + "o_proj.weight", tp_axis=1),
        Copy("decoder.layers.{i}.self_attention.linear_proj.bias", hf=a + "o_proj.bias"),
        Copy("decoder.layers.{i}.pre_mlp_layernorm.weight", hf="model.layers.{i}.post_attention_layernorm.weight"),
        Copy("decoder.layers.{i}.mlp.router.weight", hf=m + "router.weight"),
        Copy("decoder.layers.{i}.mlp.router.bias", hf=m + "router.bias"),
        StackedInterleavedGateUp(expert + "linear_fc1.weight", hf=m + "experts.gate_up_proj", **stacked),
        StackedInterleavedGateUp(expert + "linear_fc1.bias", hf=m + "experts.gate_up_proj_bias", **stacked),
        StackedExpertCopy(expert + "linear_fc2.weight", hf=m + "experts.down_proj", tp_axis=1, transpose=True,
                          **stacked),
        StackedExpertCopy(expert + "linear_fc2.bias", hf=m + "experts.down_proj_bias", **stacked),
    ]
    global_rules: list[WeightRule] = [
        Copy("embedding.word_embeddings.weight", hf="model.embed_tokens.weight", tp_axis=0, vocab=True),
        Copy("decoder.final_layernorm.weight", hf="model.norm.weight"),
        Copy("output_layer.weight", hf="model.embed_tokens.weight" if tied else "lm_head.weight", tp_axis=0,
             vocab=True),
    ]
    return layer_rules, global_rules
