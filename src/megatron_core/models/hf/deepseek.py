"""The DeepSeek-V3 family (``DeepseekV3ForCausalLM``): config mapping and weight rules.

DeepSeek-V3 is multi-latent attention (``MLATransformerConfig``: ``q_lora_rank``, ``kv_lora_rank``,
``qk_head_dim`` = ``qk_nope_head_dim``, ``qk_pos_emb_head_dim`` = ``qk_rope_head_dim``, ``v_head_dim``; the
latent RMSNorms are ``q_layernorm`` / ``kv_layernorm``, so ``qk_layernorm=True``) followed by a SwiGLU MLP on the
first ``first_k_dense_replace`` layers (``moe_layer_freq`` 0) and a MoE on the others: a sigmoid router whose
``e_score_correction_bias`` only selects experts (``moe_router_enable_expert_bias``; ``router.expert_bias``),
group-limited top-k (``n_group`` / ``topk_group``), chosen scores renormalised and multiplied by
``routed_scaling_factor``, and ``n_shared_experts`` shared experts as one MLP of ``n_shared_experts *
moe_intermediate_size`` without a gate.

RoPE: ``rope_interleave=True`` (DeepSeek's interleaved pairs) is what MLA computes, so the weights are copied
as they are. YaRN's ``factor``, ``original_max_position_embeddings``, ``beta_fast`` / ``beta_slow`` map to
``rotary_scaling_factor`` etc.; ``mscale_all_dim`` scales the softmax by ``mscale^2`` on both sides, and
``mscale`` is chosen so that Megatron-Core's cosine/sine factor ``get_mscale(f, mscale) /
get_mscale(f, mscale_all_dim)`` equals the one Hugging Face uses (its ``attention_factor``, or the
``mscale`` ratio when both are set, else ``get_mscale(f)``).

Hugging Face scores an expert group by its best two experts, Megatron-Core by its best ``topk / topk_group``:
configs where those differ are refused, as is every other setting the model cannot compute (see
:func:`deepseek_config_kwargs`).

Multi-token prediction: DeepSeek-V3 checkpoints store ``num_nextn_predict_layers`` MTP depths after the last layer
(``model.layers.<num_hidden_layers + k>.*``, which transformers does not instantiate). Depth ``k`` maps to
``mtp.layers.<k>.``: ``enorm`` / ``hnorm`` / ``eh_proj`` as they are (``eh_proj`` takes ``[enorm(embedding);
hnorm(hidden)]``, the embedding half first, in DeepSeek's inference code as in Megatron-Core), ``shared_head.norm``
-> ``final_layernorm``, and the decoder-layer tensors (a MoE layer) -> ``mtp_model_layer.*`` with a MoE decoder
layer's rules. ``embed_tokens`` and ``shared_head.head`` repeat the model's embedding and output layer
(:class:`~megatron_core.models.hf.rules.SharedCopy`).

DeepSeek-V3.2 (``DeepseekV32ForCausalLM``, :func:`deepseek_v32_config_kwargs`) is this model with DeepSeek sparse
attention as every layer's core attention (``experimental_attention_variant="dsa"``): ``index_n_heads`` /
``index_head_dim`` / ``index_topk`` are the ``dsa_indexer_*`` sizes and the indexer's ``wq_b`` / ``wk`` / ``k_norm``
(a LayerNorm with bias, epsilon 1e-6 in Hugging Face) / ``weights_proj`` its ``linear_*`` projections, whole on
every TP rank. Hugging Face skips the indexer's Hadamard rotation (it leaves the scores unchanged up to rounding),
so the import does too (``dsa_indexer_rotate_activation=False``). Its ``mlp_layer_types`` places the MoE layers.

Hugging Face's q/kv latent RMSNorms always use epsilon 1e-6 whatever ``rms_norm_eps`` says, while MLA gives every
norm ``layernorm_epsilon``: any other ``rms_norm_eps`` is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.nn.functional as F

from megatron_core.models.hf.rules import Copy, GateUp, SharedCopy, WeightRule
from megatron_core.models.hf.safetensors_io import HFConversionError

__all__ = ["deepseek_config_kwargs", "deepseek_mtp_rules", "deepseek_rules_for_layer", "deepseek_v32_config_kwargs"]


def _get(cfg: dict, name: str, default: Any = None) -> Any:
    return cfg[name] if cfg.get(name) is not None else default


def _reject(path: str, cfg: dict, name: str, bad: bool, why: str) -> None:
    if bad:
        raise HFConversionError(f"{path}: {name}={cfg.get(name)!r} is not supported ({why})")


def _get_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_fields(path: str, cfg: dict) -> dict[str, Any]:
    """MLATransformerConfig's rope fields from ``rope_parameters`` (transformers 5) or ``rope_scaling``."""
    params = {**dict(cfg.get("rope_scaling") or {}), **dict(cfg.get("rope_parameters") or {})}
    theta = float(_get(params, "rope_theta", _get(cfg, "rope_theta", 10000.0)))
    _reject(path, params, "partial_rotary_factor", float(_get(params, "partial_rotary_factor", 1.0)) != 1.0,
            "MLA rotates every qk_rope_head_dim channel")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return dict(rope_type="rope", rotary_base=theta, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if kind != "yarn":
        raise HFConversionError(f"{path}: RoPE type {kind!r} is not supported for DeepSeek-V3 (only 'yarn' and "
                                "'default')")
    _reject(path, params, "truncate", params.get("truncate", True) is False,
            "MLA's YaRN rounds the correction range to whole dimensions")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(cfg["max_position_embeddings"]) / original
    mscale_all_dim = float(params.get("mscale_all_dim") or 0.0)
    mscale, explicit = params.get("mscale"), params.get("attention_factor")
    if explicit is None and mscale and mscale_all_dim:
        mscale = float(mscale)
    else:  # solve get_mscale(f, m) / get_mscale(f, mscale_all_dim) = Hugging Face's cosine/sine factor
        target = float(explicit) if explicit is not None else _get_mscale(factor)
        if factor <= 1:
            _reject(path, params, "attention_factor", target != 1.0, "needs factor > 1")
            mscale = 1.0
        else:
            mscale = (target * _get_mscale(factor, mscale_all_dim) - 1.0) / (0.1 * math.log(factor))
    return dict(rope_type="yarn", rotary_base=theta, rotary_scaling_factor=factor,
                original_max_position_embeddings=original, beta_fast=float(_get(params, "beta_fast", 32.0)),
                beta_slow=float(_get(params, "beta_slow", 1.0)), mscale=mscale, mscale_all_dim=mscale_all_dim)


def _moe_pattern(path: str, cfg: dict, layers: int) -> list[int]:
    """1 (MoE) or 0 (dense MLP) per layer: ``mlp_layer_types`` (``"sparse"`` / ``"dense"``, DeepSeek-V3.2's
    config) where given, else the first ``first_k_dense_replace`` layers dense."""
    kinds = cfg.get("mlp_layer_types")
    if kinds is not None:
        _reject(path, cfg, "mlp_layer_types", not isinstance(kinds, list) or len(kinds) != layers
                or any(kind not in ("dense", "sparse") for kind in kinds),
                f"must list 'dense' or 'sparse' for each of the {layers} layers")
        return [1 if kind == "sparse" else 0 for kind in kinds]
    dense = int(_get(cfg, "first_k_dense_replace", 0))
    _reject(path, cfg, "first_k_dense_replace", not 0 <= dense <= layers, f"must be in [0, {layers}]")
    return [0] * dense + [1] * (layers - dense)


def _moe_fields(path: str, cfg: dict, layers: int) -> dict[str, Any]:
    """MoE fields (none when every layer is dense): router, groups, scaling, shared experts, layer pattern."""
    pattern = _moe_pattern(path, cfg, layers)
    if not any(pattern):
        return {}
    experts = int(_get(cfg, "n_routed_experts", _get(cfg, "num_local_experts", 0)))
    topk = int(cfg["num_experts_per_tok"])
    groups, group_topk = int(_get(cfg, "n_group", 1)), int(_get(cfg, "topk_group", 1))
    _reject(path, cfg, "n_routed_experts", experts < 1, "a MoE layer needs experts")
    _reject(path, cfg, "norm_topk_prob", not cfg.get("norm_topk_prob", True) and topk > 1,
            "Megatron-Core's sigmoid router always renormalises the chosen scores when top-k > 1")
    _reject(path, cfg, "norm_topk_prob", bool(cfg.get("norm_topk_prob", True)) and topk == 1,
            "with top-1, Megatron-Core's sigmoid router keeps the score unnormalised")
    _reject(path, cfg, "topk_group", groups == 1 and group_topk != 1, "one group allows topk_group 1 only")
    _reject(path, cfg, "n_group", groups < 1 or experts % groups != 0 or experts // groups < 2,
            f"n_routed_experts ({experts}) must split into groups of at least 2 experts")
    if groups > 1:
        _reject(path, cfg, "topk_group", topk % group_topk != 0 or topk // group_topk != 2,
                f"Hugging Face scores a group by its best 2 experts, Megatron-Core by its best num_experts_per_tok "
                f"/ topk_group ({topk} / {group_topk}); they must agree")
    fields: dict[str, Any] = dict(
        num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        moe_layer_freq=1 if all(pattern) else pattern, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        moe_router_topk_scaling_factor=float(_get(cfg, "routed_scaling_factor", 1.0)),
    )
    if groups > 1:
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    shared = int(_get(cfg, "n_shared_experts", 0))
    if shared:
        fields["moe_shared_expert_intermediate_size"] = shared * int(cfg["moe_intermediate_size"])
    return fields


def deepseek_config_kwargs(path: str, cfg: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(MLATransformerConfig fields, GPTModel arguments)`` of a ``DeepseekV3ForCausalLM`` config."""
    hidden, heads, layers = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    _reject(path, cfg, "hidden_act", cfg.get("hidden_act", "silu") != "silu", "DeepSeek's MLPs are SwiGLU")
    _reject(path, cfg, "attention_bias", bool(cfg.get("attention_bias")),
            "MLA's projections have no biases (the output projection's would need add_bias_linear)")
    _reject(path, cfg, "num_key_value_heads", int(_get(cfg, "num_key_value_heads", heads)) != heads,
            "MLA up-projects one key/value head per query head")
    _reject(path, cfg, "rope_interleave", cfg.get("rope_interleave", True) is False,
            "MLA rotates DeepSeek's interleaved RoPE pairs (rope_interleave=True)")
    _reject(path, cfg, "pretraining_tp", int(_get(cfg, "pretraining_tp", 1)) != 1, "only 1")
    _reject(path, cfg, "rms_norm_eps", float(_get(cfg, "rms_norm_eps", 1e-6)) != 1e-6,
            "Hugging Face's q/kv latent norms always use 1e-6, MLA's use the one layernorm_epsilon of every norm")
    q_lora = cfg.get("q_lora_rank")
    config: dict[str, Any] = dict(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=int(cfg["intermediate_size"]),
        normalization="RMSNorm", layernorm_epsilon=float(_get(cfg, "rms_norm_eps", 1e-6)), gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0,
        attention_dropout=float(cfg.get("attention_dropout") or 0.0), multi_latent_attention=True,
        q_lora_rank=int(q_lora) if q_lora is not None else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_head_dim=int(cfg["qk_nope_head_dim"]), qk_pos_emb_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]), **_rope_fields(path, cfg), **_moe_fields(path, cfg, layers),
    )
    model = dict(position_embedding_type="rope", rotary_base=config["rotary_base"],
                 share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
                 max_sequence_length=int(_get(cfg, "max_position_embeddings", 4096)))
    return config, model


_DSA_DEFAULTS = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}  # DeepseekV32Config's


def deepseek_v32_config_kwargs(path: str, cfg: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(MLATransformerConfig fields, GPTModel arguments)`` of a ``DeepseekV32ForCausalLM`` config: DeepSeek-V3's,
    with DeepSeek sparse attention (``experimental_attention_variant="dsa"``) as every layer's core attention."""
    layers, rope = int(cfg["num_hidden_layers"]), int(cfg["qk_rope_head_dim"])
    _reject(path, cfg, "q_lora_rank", cfg.get("q_lora_rank") is None,
            "DeepSeek-V3.2's attention and its indexer read the query latent, so it needs a q_lora_rank")
    kinds = cfg.get("layer_types")
    _reject(path, cfg, "layer_types", kinds is not None and (not isinstance(kinds, list) or len(kinds) != layers
            or any(kind != "indexed_attention" for kind in kinds)),
            f"each of the {layers} layers must be 'indexed_attention' (DeepSeek sparse attention)")
    heads, dim, topk = (int(_get(cfg, name, default)) for name, default in _DSA_DEFAULTS.items())
    _reject(path, cfg, "index_n_heads", heads < 1, "must be >= 1")
    _reject(path, cfg, "index_head_dim", dim < rope,
            f"the indexer rotates its first qk_rope_head_dim ({rope}) channels, so it needs at least as many")
    _reject(path, cfg, "index_topk", topk < 1, "must be >= 1")
    config, model = deepseek_config_kwargs(path, cfg)
    config.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=heads, dsa_indexer_head_dim=dim,
                  dsa_indexer_topk=topk, dsa_indexer_k_norm_epsilon=1e-6, dsa_indexer_rotate_activation=False)
    return config, model


def _indexer_rules() -> list[WeightRule]:
    """DeepSeek-V3.2's indexer (``self_attn.indexer.*``), whole on every TP rank as DSAIndexer duplicates it."""
    a, m = "model.layers.{i}.self_attn.indexer.", "decoder.layers.{i}.self_attention.core_attention.indexer."
    return [Copy(m + "linear_wq_b.weight", hf=a + "wq_b.weight"), Copy(m + "linear_wk.weight", hf=a + "wk.weight"),
            Copy(m + "k_norm.weight", hf=a + "k_norm.weight"), Copy(m + "k_norm.bias", hf=a + "k_norm.bias"),
            Copy(m + "linear_weights_proj.weight", hf=a + "weights_proj.weight")]


def _attention_rules(q_lora: bool) -> list[WeightRule]:
    a, m = "model.layers.{i}.self_attn.", "decoder.layers.{i}.self_attention."
    rules: list[WeightRule] = [
        Copy("decoder.layers.{i}.input_layernorm.weight", hf="model.layers.{i}.input_layernorm.weight"),
        Copy(m + "linear_kv_down_proj.weight", hf=a + "kv_a_proj_with_mqa.weight", tp_axis=0),
        Copy(m + "kv_layernorm.weight", hf=a + "kv_a_layernorm.weight"),
        Copy(m + "linear_kv_up_proj.weight", hf=a + "kv_b_proj.weight", tp_axis=0),
        Copy(m + "linear_proj.weight", hf=a + "o_proj.weight", tp_axis=1),
        Copy("decoder.layers.{i}.pre_mlp_layernorm.weight", hf="model.layers.{i}.post_attention_layernorm.weight"),
    ]
    if q_lora:
        rules += [Copy(m + "linear_q_down_proj.weight", hf=a + "q_a_proj.weight", tp_axis=0),
                  Copy(m + "q_layernorm.weight", hf=a + "q_a_layernorm.weight"),
                  Copy(m + "linear_q_up_proj.weight", hf=a + "q_b_proj.weight", tp_axis=0)]
    else:
        rules.append(Copy(m + "linear_q_proj.weight", hf=a + "q_proj.weight", tp_axis=0))
    return rules


def _mlp_rules(prefix: str, hf: str) -> list[WeightRule]:
    return [GateUp(prefix + "linear_fc1.weight", gate=hf + "gate_proj.weight", up=hf + "up_proj.weight"),
            Copy(prefix + "linear_fc2.weight", hf=hf + "down_proj.weight", tp_axis=1)]


def deepseek_rules_for_layer(config: dict[str, Any]
                             ) -> tuple[list[WeightRule], list[WeightRule], Callable[[int], list[WeightRule]]]:
    """``(dense-layer rules, MoE-layer rules, layer -> its rules)`` for DeepSeek-V3's tensor names."""
    attention = _attention_rules(config["q_lora_rank"] is not None)
    if config.get("experimental_attention_variant") == "dsa":
        attention += _indexer_rules()
    m, hf = "decoder.layers.{i}.mlp.", "model.layers.{i}.mlp."
    dense = attention + _mlp_rules(m, hf)
    moe = attention + [Copy(m + "router.weight", hf=hf + "gate.weight"),
                       Copy(m + "router.expert_bias", hf=hf + "gate.e_score_correction_bias")]
    moe += _mlp_rules(m + "experts.local_experts.{e}.", hf + "experts.{e}.")
    if config.get("moe_shared_expert_intermediate_size"):
        moe += _mlp_rules(m + "shared_experts.", hf + "shared_experts.")
    freq = config.get("moe_layer_freq", 1)
    experts = config.get("num_moe_experts")

    def rules_for(layer: int) -> list[WeightRule]:
        if not experts:
            return dense
        return moe if (freq[layer] if isinstance(freq, list) else layer % freq == 0) else dense

    return dense, (moe if experts else []), rules_for


def deepseek_mtp_rules(moe_rules: list[WeightRule], tied: bool) -> tuple[list[WeightRule], list[SharedCopy]]:
    """``(rules of one MTP depth, its shared embedding / head copies)``: ``{i}`` is the HF layer index
    ``num_hidden_layers + k`` of depth ``k`` (``mtp.layers.{i}.`` is a key, the bridge finds depth ``k`` itself)."""
    m, hf = "mtp.layers.{i}.", "model.layers.{i}."
    rules: list[WeightRule] = [
        Copy(m + "enorm.weight", hf=hf + "enorm.weight"),
        Copy(m + "hnorm.weight", hf=hf + "hnorm.weight"),
        Copy(m + "eh_proj.weight", hf=hf + "eh_proj.weight", tp_axis=0),
        Copy(m + "final_layernorm.weight", hf=hf + "shared_head.norm.weight"),
    ]
    rules += [replace(r, mcore=r.mcore.replace("decoder.layers.{i}.", m + "mtp_model_layer.")) for r in moe_rules]
    shared = [
        SharedCopy(m + "shared.word_embeddings.weight", hf=hf + "embed_tokens.weight", tp_axis=0, vocab=True,
                   source="embedding.word_embeddings.weight"),
        SharedCopy(m + "shared.output_layer.weight", hf=hf + "shared_head.head.weight", tp_axis=0, vocab=True,
                   source="embedding.word_embeddings.weight" if tied else "output_layer.weight"),
    ]
    return rules, shared
