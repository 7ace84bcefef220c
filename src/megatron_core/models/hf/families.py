"""Model families: a Hugging Face ``config.json`` -> TransformerConfig fields, GPTModel arguments, weight rules.

Supported ``architectures``: ``LlamaForCausalLM`` (Llama 2, 3, 3.1+ with ``llama3`` RoPE
scaling), ``MistralForCausalLM`` (sliding window), ``Qwen2ForCausalLM`` (QKV biases), ``Qwen3ForCausalLM`` (per-head q/k RMSNorm),
``GPT2LMHeadModel`` (``Conv1D`` layout, learned positions, tied embeddings), and the MoE models
``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` (router, per-expert tensors, shared expert
with its sigmoid gate) and ``Qwen3MoeForCausalLM`` (q/k norms, no shared expert), dense layers where
``mlp_only_layers`` / ``decoder_sparse_step`` put them, in the per-expert tensor names ``save_pretrained`` writes,
``Qwen3NextForCausalLM`` (gated delta net and gated attention layers, zero-centred norms, partial RoPE, MoE with a
gated shared expert: :mod:`.qwen3_next`), and
``GptOssForCausalLM`` (attention sinks, YaRN, alternating sliding windows, biased router and stacked
experts with a clamped, offset GLU: :mod:`.gpt_oss`), and ``DeepseekV3ForCausalLM`` (multi-latent attention,
first dense layers, sigmoid-routed MoE with expert bias, group-limited routing, shared experts and the
multi-token-prediction layers: :mod:`.deepseek`) with ``DeepseekV32ForCausalLM`` (the same model with DeepSeek
sparse attention: its lightning indexer picks ``index_topk`` keys per query); the hybrid Mamba models
``NemotronHForCausalLM`` and ``Mamba2ForCausalLM`` convert to :class:`~megatron_core.models.hybrid.HybridModel` (:mod:`.hybrid`). Architectures
that the model code cannot express yet are listed in :data:`NOT_SUPPORTED` with the reason.
Every config field that changes the computation and is not supported raises
:class:`HFConversionError` naming ``config.json``, the field and its value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core.models.hf.deepseek import (
    deepseek_config_kwargs,
    deepseek_mtp_rules,
    deepseek_rules_for_layer,
    deepseek_v32_config_kwargs,
)
from megatron_core.models.hf.gpt_oss import gpt_oss_config_kwargs, gpt_oss_rules
from megatron_core.models.hf.hybrid import mamba2_family_parts, nemotron_h_family_parts
from megatron_core.models.hf.qwen3_next import (
    linear_attention_pattern,
    qwen3_next_layer_parts,
    qwen3_next_mtp,
)
from megatron_core.models.hf.rules import Copy, FusedQKV, GateUp, SharedCopy, WeightRule
from megatron_core.models.hf.safetensors_io import HFConversionError

NOT_SUPPORTED = {
    "GemmaForCausalLM": "GPTModel does not multiply the word embeddings by sqrt(hidden_size) as Gemma does",
    "Gemma2ForCausalLM": "needs embedding scaling, logit soft-capping and post-attention/post-MLP norms",
    "Gemma3ForCausalLM": "needs embedding scaling, sandwich norms and local/global attention layers",
}

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU (Hugging Face's ``gelu_new`` / ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_new": gelu_tanh,
                "gelu_pytorch_tanh": gelu_tanh, "gelu_fast": gelu_tanh}


@dataclass
class Family:
    """Everything needed to build and fill a GPTModel (or, with ``hybrid_pattern``, a HybridModel) for one HF config."""

    architecture: str
    config_kwargs: dict[str, Any]
    model_kwargs: dict[str, Any]
    layer_rules: list[WeightRule]
    global_rules: list[WeightRule]
    vocab_size: int
    num_layers: int
    dtype: torch.dtype | None
    rope_llama3: dict[str, float] | None = None
    ignored_suffixes: tuple[str, ...] = field(default_factory=tuple)
    # HF tensors that are read by no rule and may be present (e.g. multi-token-prediction layers)
    ignored_prefixes: tuple[str, ...] = field(default_factory=tuple)
    # The rules of one layer, where layers differ (dense and MoE); None: every layer has all layer_rules
    rules_for_layer: Callable[[int], list[WeightRule]] | None = None
    # Suffixes of the persistent buffers converted like parameters (e.g. the router's expert_bias)
    buffers: tuple[str, ...] = field(default_factory=tuple)
    # Multi-token prediction: depths, the rules of one depth (``{i}`` = HF layer num_layers + depth) and the
    # HF tensors of a depth that repeat the embedding / output layer
    mtp_num_layers: int = 0
    mtp_rules: list[WeightRule] = field(default_factory=list)
    mtp_shared: list[SharedCopy] = field(default_factory=list)
    # A hybrid model (HybridModel): its layer pattern and its Mamba mixers' constructor arguments (d_conv, chunk_size)
    hybrid_pattern: str | None = None
    mixer_params: dict[str, Any] = field(default_factory=dict)
    # HF tensor name prefixes that are refused with the reason when the checkpoint has any (e.g. MTP layers
    # the model cannot hold)
    refused_prefixes: dict[str, str] = field(default_factory=dict)

    def without_mtp(self) -> Family:
        """This family with no multi-token-prediction layers (a checkpoint that stores none)."""
        config = {k: v for k, v in self.config_kwargs.items() if k != "mtp_num_layers"}
        return replace(self, config_kwargs=config, mtp_num_layers=0, mtp_rules=[], mtp_shared=[])

    def layer_rules_of(self, layer: int) -> list[WeightRule]:
        """The rules of global layer ``layer``."""
        return self.rules_for_layer(layer) if self.rules_for_layer is not None else self.layer_rules


def _get(cfg: dict, *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _reject(path: str, cfg: dict, name: str, bad: bool, why: str) -> None:
    if bad:
        raise HFConversionError(f"{path}: {name}={cfg.get(name)!r} is not supported ({why})")


def _dtype(cfg: dict) -> torch.dtype | None:
    value = _get(cfg, "dtype", "torch_dtype")
    return _DTYPES.get(str(value).replace("torch.", "")) if value is not None else None


def _rope(path: str, cfg: dict) -> tuple[float, dict[str, float] | None]:
    """``(rope_theta, llama3 scaling or None)`` from ``rope_parameters`` (transformers 5) or the older fields."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(_get(merged, "rope_theta", default=_get(cfg, "rope_theta", default=10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise HFConversionError(f"{path}: RoPE scaling type {kind!r} is not supported (only 'default' and 'llama3')")
    return theta, {
        "factor": float(merged["factor"]),
        "low_freq_factor": float(merged.get("low_freq_factor", 1.0)),
        "high_freq_factor": float(merged.get("high_freq_factor", 4.0)),
        "original_max_position_embeddings": int(merged.get("original_max_position_embeddings", 8192)),
    }


def _llama_like(path: str, cfg: dict, arch: str, qkv_bias: bool, qk_norm: bool, moe: str | None = None) -> Family:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    groups = int(_get(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_get(cfg, "head_dim", default=hidden // heads))
    layers = int(cfg["num_hidden_layers"])
    act = cfg.get("hidden_act", "silu")
    _reject(path, cfg, "hidden_act", act not in _ACTIVATIONS, f"known: {sorted(_ACTIVATIONS)}")
    _reject(path, cfg, "mlp_bias", bool(cfg.get("mlp_bias")), "GPTModel has no MLP-only bias switch")
    _reject(path, cfg, "use_sliding_window", bool(cfg.get("use_sliding_window")),
            "Qwen's per-layer sliding windows (max_window_layers)")
    _reject(path, cfg, "pretraining_tp", int(cfg.get("pretraining_tp") or 1) != 1, "only 1")
    _reject(path, cfg, "attention_bias", bool(cfg.get("attention_bias")) and arch != "Qwen2ForCausalLM",
            "it adds an o_proj bias too, which GPTModel cannot add without MLP biases")
    theta, llama3 = _rope(path, cfg)
    tied = bool(cfg.get("tie_word_embeddings", False))
    config_kwargs = dict(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=head_dim, ffn_hidden_size=int(cfg["intermediate_size"]), normalization="RMSNorm",
        layernorm_epsilon=float(_get(cfg, "rms_norm_eps", default=1e-6)), gated_linear_unit=True,
        activation_func=_ACTIVATIONS[act], add_bias_linear=False, add_qkv_bias=qkv_bias, qk_layernorm=qk_norm,
        hidden_dropout=0.0, attention_dropout=float(cfg.get("attention_dropout") or 0.0),
    )
    window = cfg.get("sliding_window") if arch in ("MistralForCausalLM", "MixtralForCausalLM") else None
    if window:  # HF sees a key while q - k < W: Megatron's window_size (W - 1, 0)
        config_kwargs["window_size"] = (int(window) - 1, 0)
    model_kwargs = dict(
        position_embedding_type="rope", rotary_base=theta, share_embeddings_and_output_weights=tied,
        max_sequence_length=int(_get(cfg, "max_position_embeddings", default=4096)),
    )
    if llama3 is not None:
        model_kwargs.update(rope_scaling=True, rope_scaling_factor=llama3["factor"])
    qkv = dict(num_heads=heads, num_groups=groups, head_dim=head_dim)
    a = "model.layers.{i}.self_attn."
    attention: list[WeightRule] = [
        Copy("decoder.layers.{i}.input_layernorm.weight", hf="model.layers.{i}.input_layernorm.weight"),
        FusedQKV("decoder.layers.{i}.self_attention.linear_qkv.weight",
                 parts=(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), **qkv),
        Copy("decoder.layers.{i}.self_attention.linear_proj.weight", hf=a + "o_proj.weight", tp_axis=1),
    ]
    if qkv_bias:
        attention.append(FusedQKV("decoder.layers.{i}.self_attention.linear_qkv.bias",
                                  parts=(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), **qkv))
    if qk_norm:
        attention += [Copy("decoder.layers.{i}.self_attention.q_layernorm.weight", hf=a + "q_norm.weight"),
                      Copy("decoder.layers.{i}.self_attention.k_layernorm.weight", hf=a + "k_norm.weight")]
    moe_config, moe_rules, moe_pattern = _moe(path, cfg, moe, layers) if moe is not None else ({}, [], [0] * layers)
    config_kwargs.update(moe_config)
    layer_rules, rules_for_layer = _layer_rules(layers, lambda i: attention, moe_rules, moe_pattern)
    global_rules: list[WeightRule] = [
        Copy("embedding.word_embeddings.weight", hf="model.embed_tokens.weight", tp_axis=0, vocab=True),
        Copy("decoder.final_layernorm.weight", hf="model.norm.weight"),
        Copy("output_layer.weight", hf="model.embed_tokens.weight" if tied else "lm_head.weight", tp_axis=0,
             vocab=True),
    ]
    return Family(arch, config_kwargs, model_kwargs, layer_rules, global_rules, int(cfg["vocab_size"]), layers,
                  _dtype(cfg), rope_llama3=llama3, ignored_suffixes=("rotary_emb.inv_freq",),
                  rules_for_layer=rules_for_layer)


def _gpt2(path: str, cfg: dict) -> Family:
    hidden = int(_get(cfg, "n_embd", "hidden_size"))
    heads = int(_get(cfg, "n_head", "num_attention_heads"))
    layers = int(_get(cfg, "n_layer", "num_hidden_layers"))
    act = cfg.get("activation_function", "gelu_new")
    _reject(path, cfg, "activation_function", act not in _ACTIVATIONS, f"known: {sorted(_ACTIVATIONS)}")
    _reject(path, cfg, "scale_attn_by_inverse_layer_idx", bool(cfg.get("scale_attn_by_inverse_layer_idx")),
            "per-layer attention scaling")
    _reject(path, cfg, "add_cross_attention", bool(cfg.get("add_cross_attention")), "decoder-only models")
    _reject(path, cfg, "tie_word_embeddings", cfg.get("tie_word_embeddings") is False, "GPT-2 files hold no lm_head")
    head_dim = hidden // heads
    config_kwargs = dict(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=int(cfg.get("n_inner") or 4 * hidden), normalization="LayerNorm",
        layernorm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)), activation_func=_ACTIVATIONS[act],
        add_bias_linear=True, hidden_dropout=0.0, attention_dropout=0.0,
        softmax_scale=None if cfg.get("scale_attn_weights", True) else 1.0,
    )
    model_kwargs = dict(position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True,
                        max_sequence_length=int(_get(cfg, "n_positions", "max_position_embeddings", default=1024)))
    h = "transformer.h.{i}."
    qkv = dict(num_heads=heads, num_groups=heads, head_dim=head_dim)
    layer_rules: list[WeightRule] = [
        Copy("decoder.layers.{i}.input_layernorm.weight", hf=h + "ln_1.weight"),
        Copy("decoder.layers.{i}.input_layernorm.bias", hf=h + "ln_1.bias"),
        FusedQKV("decoder.layers.{i}.self_attention.linear_qkv.weight", parts=(h + "attn.c_attn.weight",) * 3,
                 transpose=True, **qkv),
        FusedQKV("decoder.layers.{i}.self_attention.linear_qkv.bias", parts=(h + "attn.c_attn.bias",) * 3, **qkv),
        Copy("decoder.layers.{i}.self_attention.linear_proj.weight", hf=h + "attn.c_proj.weight", tp_axis=1,
             transpose=True),
        Copy("decoder.layers.{i}.self_attention.linear_proj.bias", hf=h + "attn.c_proj.bias"),
        Copy("decoder.layers.{i}.pre_mlp_layernorm.weight", hf=h + "ln_2.weight"),
        Copy("decoder.layers.{i}.pre_mlp_layernorm.bias", hf=h + "ln_2.bias"),
        Copy("decoder.layers.{i}.mlp.linear_fc1.weight", hf=h + "mlp.c_fc.weight", tp_axis=0, transpose=True),
        Copy("decoder.layers.{i}.mlp.linear_fc1.bias", hf=h + "mlp.c_fc.bias", tp_axis=0),
        Copy("decoder.layers.{i}.mlp.linear_fc2.weight", hf=h + "mlp.c_proj.weight", tp_axis=1, transpose=True),
        Copy("decoder.layers.{i}.mlp.linear_fc2.bias", hf=h + "mlp.c_proj.bias"),
    ]
    global_rules: list[WeightRule] = [
        Copy("embedding.word_embeddings.weight", hf="transformer.wte.weight", tp_axis=0, vocab=True),
        Copy("embedding.position_embeddings.weight", hf="transformer.wpe.weight"),
        Copy("decoder.final_layernorm.weight", hf="transformer.ln_f.weight"),
        Copy("decoder.final_layernorm.bias", hf="transformer.ln_f.bias"),
        Copy("output_layer.weight", hf="transformer.wte.weight", tp_axis=0, vocab=True),
    ]
    return Family("GPT2LMHeadModel", config_kwargs, model_kwargs, layer_rules, global_rules, int(cfg["vocab_size"]),
                  layers, _dtype(cfg), ignored_suffixes=(".attn.bias", ".attn.masked_bias"))


SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel",
             "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
             "GptOssForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "NemotronHForCausalLM",
             "Mamba2ForCausalLM")


def _qwen3_next(path: str, cfg: dict) -> Family:
    """Qwen3-Next: the Qwen3-MoE family's attention, MLPs and globals, with gated delta net layers by
    ``layer_types``, gated attention, zero-centred norms and partial RoPE (:mod:`.qwen3_next`)."""
    _reject(path, cfg, "hidden_act", cfg.get("hidden_act", "silu") != "silu",
            "only 'silu': the delta net's output gate is SiLU in Hugging Face whatever hidden_act says")
    base = _llama_like(path, cfg, "Qwen3NextForCausalLM", qkv_bias=False, qk_norm=True, moe="qwen3_next")
    c = base.config_kwargs
    layers = c["num_layers"]
    linear = linear_attention_pattern(path, cfg, layers)
    gdn_config, gdn, attention = qwen3_next_layer_parts(cfg, c["num_attention_heads"], c["num_query_groups"],
                                                         c["kv_channels"])
    moe_rules = [r for r in base.layer_rules if ".mlp.router." in r.mcore or ".mlp.experts." in r.mcore
                 or ".mlp.shared_experts." in r.mcore]
    moe_pattern = c.get("moe_layer_freq") or [1] * layers
    layer_rules, rules_for = _layer_rules(layers, lambda i: gdn if linear[i] else attention, moe_rules, moe_pattern)
    config_kwargs = {**c, **gdn_config, "linear_attention_freq": linear}
    mtp, mtp_rules, refused = qwen3_next_mtp(cfg, (rules_for or (lambda i: layer_rules))(layers - 1), bool(linear[-1]))
    if mtp:
        config_kwargs["mtp_num_layers"] = mtp
    theta = base.model_kwargs["rotary_base"]
    percent = float(_get({**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})},
                         "partial_rotary_factor", default=_get(cfg, "partial_rotary_factor", default=1.0)))
    model_kwargs = {**base.model_kwargs, "rotary_base": theta, "rotary_percent": percent}
    return replace(base, config_kwargs=config_kwargs, model_kwargs=model_kwargs, layer_rules=layer_rules,
                   rules_for_layer=rules_for, refused_prefixes=refused, mtp_num_layers=mtp, mtp_rules=mtp_rules)


def _hybrid(path: str, cfg: dict, arch: str, hf_prefix: str | None) -> Family:
    """A NemotronH or Mamba2 config as a hybrid family: the rules of each layer follow its pattern symbol."""
    if arch == "NemotronHForCausalLM":
        parts = nemotron_h_family_parts(path, cfg, hf_prefix or "backbone.")
    else:
        parts = mamba2_family_parts(path, cfg)
    pattern, by_symbol = parts["pattern"], parts["by_symbol"]
    union = list({r.mcore: r for rules in by_symbol.values() for r in rules}.values())
    model_kwargs = dict(position_embedding_type="none", share_embeddings_and_output_weights=parts["tied"],
                        max_sequence_length=parts["max_sequence_length"], hybrid_layer_pattern=pattern)
    return Family(arch, parts["config_kwargs"], model_kwargs, union, parts["global_rules"], int(cfg["vocab_size"]),
                  len(pattern), _dtype(cfg), rules_for_layer=lambda i: by_symbol[pattern[i]],
                  hybrid_pattern=pattern, mixer_params=parts["mixer_params"])


def _deepseek(path: str, cfg: dict, arch: str) -> Family:
    """DeepSeek-V3, or V3.2 (``DeepseekV32ForCausalLM``: the same model with DeepSeek sparse attention)."""
    v32 = arch == "DeepseekV32ForCausalLM"
    config_kwargs, model_kwargs = (deepseek_v32_config_kwargs if v32 else deepseek_config_kwargs)(path, cfg)
    dense, moe, rules_for = deepseek_rules_for_layer(config_kwargs)
    union = list({r.mcore: r for r in dense + moe}.values())
    tied = model_kwargs["share_embeddings_and_output_weights"]
    global_rules: list[WeightRule] = [
        Copy("embedding.word_embeddings.weight", hf="model.embed_tokens.weight", tp_axis=0, vocab=True),
        Copy("decoder.final_layernorm.weight", hf="model.norm.weight"),
        Copy("output_layer.weight", hf="model.embed_tokens.weight" if tied else "lm_head.weight", tp_axis=0,
             vocab=True),
    ]
    layers = config_kwargs["num_layers"]
    mtp = int(_get(cfg, "num_nextn_predict_layers", "num_mtp_layers", default=0))
    _reject(path, cfg, "num_nextn_predict_layers", mtp < 0, "must be >= 0")
    mtp_rules: list[WeightRule] = []
    mtp_shared: list[SharedCopy] = []
    # DeepSeek's MTP layer (index >= first_k_dense_replace) is a MoE layer: an all-dense model converts without
    # MTP (MTP tensors in its files are then refused as having no place)
    mtp = mtp if moe else 0
    freq = config_kwargs.get("moe_layer_freq")
    _reject(path, cfg, "mlp_layer_types", bool(mtp) and isinstance(freq, list) and not freq[-1],
            "the multi-token-prediction layers are MoE layers built like the last layer, which is dense here")
    if mtp:
        config_kwargs["mtp_num_layers"] = mtp
        mtp_rules, mtp_shared = deepseek_mtp_rules(moe, tied)
    return Family(arch, config_kwargs, model_kwargs, union, global_rules, int(cfg["vocab_size"]),
                  layers, _dtype(cfg), ignored_suffixes=("rotary_emb.inv_freq",), rules_for_layer=rules_for,
                  buffers=("router.expert_bias",), mtp_num_layers=mtp, mtp_rules=mtp_rules, mtp_shared=mtp_shared)


def _gpt_oss(path: str, cfg: dict) -> Family:
    config_kwargs, model_kwargs = gpt_oss_config_kwargs(path, cfg)
    layer_rules, global_rules = gpt_oss_rules(config_kwargs, model_kwargs["share_embeddings_and_output_weights"])
    return Family("GptOssForCausalLM", config_kwargs, model_kwargs, layer_rules, global_rules, int(cfg["vocab_size"]),
                  config_kwargs["num_layers"], _dtype(cfg), ignored_suffixes=("rotary_emb.inv_freq",))


def _dense_mlp_rules() -> list[WeightRule]:
    """A SwiGLU MLP's ``linear_fc1`` (gate and up) and ``linear_fc2`` from ``mlp.{gate,up,down}_proj``."""
    return [
        GateUp("decoder.layers.{i}.mlp.linear_fc1.weight", gate="model.layers.{i}.mlp.gate_proj.weight",
               up="model.layers.{i}.mlp.up_proj.weight"),
        Copy("decoder.layers.{i}.mlp.linear_fc2.weight", hf="model.layers.{i}.mlp.down_proj.weight", tp_axis=1),
    ]


def _layer_rules(layers: int, attention_of: Callable[[int], list[WeightRule]], moe_rules: list[WeightRule],
                 moe_pattern: list[int]) -> tuple[list[WeightRule], Callable[[int], list[WeightRule]] | None]:
    """``(every rule, layer -> its rules or None where all layers are alike)``: each layer is its attention
    rules, the pre-MLP norm and the MoE (``moe_pattern`` 1) or dense SwiGLU MLP rules."""
    pre_mlp = Copy("decoder.layers.{i}.pre_mlp_layernorm.weight", hf="model.layers.{i}.post_attention_layernorm.weight")
    dense = _dense_mlp_rules()
    per_layer = [[*attention_of(i), pre_mlp, *(moe_rules if moe_pattern[i] else dense)] for i in range(layers)]
    if all(rules == per_layer[0] for rules in per_layer):
        return per_layer[0], None
    union = list({r.mcore: r for rules in per_layer for r in rules}.values())
    return union, lambda i: per_layer[i]


def _qwen_moe_pattern(path: str, cfg: dict, layers: int) -> list[int]:
    """1 (MoE) or 0 (dense MLP) per layer by Qwen's rule: MoE unless in ``mlp_only_layers`` and only where
    ``(layer + 1) % decoder_sparse_step == 0``."""
    step = int(_get(cfg, "decoder_sparse_step", default=1))
    _reject(path, cfg, "decoder_sparse_step", step < 1, "must be >= 1")
    only = cfg.get("mlp_only_layers") or []
    _reject(path, cfg, "mlp_only_layers", any(not 0 <= int(i) < layers for i in only),
            f"layer indices must lie in [0, {layers})")
    experts = int(_get(cfg, "num_experts", "num_local_experts", default=0))
    pattern = [0 if i in only or (i + 1) % step or experts <= 0 else 1 for i in range(layers)]
    if not any(pattern):
        raise HFConversionError(f"{path}: num_experts={experts!r}, decoder_sparse_step={step!r} and mlp_only_layers="
                                f"{only!r} leave no MoE layer, which is not supported for this architecture")
    return pattern


def _moe(path: str, cfg: dict, kind: str, layers: int) -> tuple[dict[str, Any], list[WeightRule], list[int]]:
    """MoE config fields, the router / expert / shared-expert rules (HF's per-expert tensor names) and the 0/1
    MoE pattern over the layers (``moe_layer_freq``, a list where dense layers mix in)."""
    _reject(path, cfg, "router_jitter_noise", float(cfg.get("router_jitter_noise") or 0.0) > 0, "only 0")
    layer = "model.layers.{i}."
    if kind == "mixtral":
        experts = int(cfg["num_local_experts"])
        prefix = layer + "block_sparse_moe."
        gate, up, down = "w1", "w3", "w2"
        config = dict(moe_ffn_hidden_size=int(cfg["intermediate_size"]), moe_router_pre_softmax=False)
        pattern = [1] * layers
    else:  # Qwen: transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
        experts = int(_get(cfg, "num_experts", "num_local_experts"))
        pattern = _qwen_moe_pattern(path, cfg, layers)
        prefix = layer + "mlp."
        gate, up, down = "gate_proj", "up_proj", "down_proj"
        config = dict(moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                      moe_router_pre_softmax=not cfg.get("norm_topk_prob", False))
        if not all(pattern):
            config["moe_layer_freq"] = pattern
    config.update(num_moe_experts=experts, moe_router_topk=int(cfg["num_experts_per_tok"]))
    expert = "decoder.layers.{i}.mlp.experts.local_experts.{e}."
    rules: list[WeightRule] = [
        Copy("decoder.layers.{i}.mlp.router.weight", hf=prefix + "gate.weight"),
        GateUp(expert + "linear_fc1.weight", gate=prefix + f"experts.{{e}}.{gate}.weight",
               up=prefix + f"experts.{{e}}.{up}.weight"),
        Copy(expert + "linear_fc2.weight", hf=prefix + f"experts.{{e}}.{down}.weight", tp_axis=1),
    ]
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if kind in ("qwen2_moe", "qwen3_next") else 0
    if shared:
        config.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
        rules += [
            GateUp("decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight", gate=prefix + "shared_expert.gate_proj.weight",
                   up=prefix + "shared_expert.up_proj.weight"),
            Copy("decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight", hf=prefix + "shared_expert.down_proj.weight",
                 tp_axis=1),
            Copy("decoder.layers.{i}.mlp.shared_experts.gate_weight", hf=prefix + "shared_expert_gate.weight"),
        ]
    return config, rules, pattern


def family_from_config(cfg: dict, path: str = "config.json", hf_prefix: str | None = None) -> Family:
    """The :class:`Family` for an HF config dict (``path`` names the file in error messages); ``hf_prefix``
    chooses NemotronH's tensor name prefix (``backbone.``, the default, or ``model.``)."""
    archs = cfg.get("architectures") or []
    if len(archs) != 1:
        raise HFConversionError(f"{path}: 'architectures' must name exactly one model class, got {archs!r}")
    arch = archs[0]
    if arch in NOT_SUPPORTED:
        raise HFConversionError(f"{path}: architecture {arch!r} is not supported: {NOT_SUPPORTED[arch]}")
    try:
        if arch == "LlamaForCausalLM":
            return _llama_like(path, cfg, arch, qkv_bias=False, qk_norm=False)
        if arch == "Qwen2ForCausalLM":
            return _llama_like(path, cfg, arch, qkv_bias=True, qk_norm=False)
        if arch == "Qwen3ForCausalLM":
            return _llama_like(path, cfg, arch, qkv_bias=False, qk_norm=True)
        if arch == "GPT2LMHeadModel":
            return _gpt2(path, cfg)
        if arch == "MistralForCausalLM":
            return _llama_like(path, cfg, arch, qkv_bias=False, qk_norm=False)
        if arch == "MixtralForCausalLM":
            return _llama_like(path, cfg, arch, qkv_bias=False, qk_norm=False, moe="mixtral")
        if arch == "GptOssForCausalLM":
            return _gpt_oss(path, cfg)
        if arch in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"):
            return _deepseek(path, cfg, arch)
        if arch in ("NemotronHForCausalLM", "Mamba2ForCausalLM"):
            return _hybrid(path, cfg, arch, hf_prefix)
        if arch == "Qwen2MoeForCausalLM":
            return _llama_like(path, cfg, arch, qkv_bias=bool(cfg.get("qkv_bias", True)), qk_norm=False,
                               moe="qwen2_moe")
        if arch == "Qwen3MoeForCausalLM":
            return _llama_like(path, cfg, arch, qkv_bias=False, qk_norm=True, moe="qwen3_moe")
        if arch == "Qwen3NextForCausalLM":
            return _qwen3_next(path, cfg)
    except HFConversionError:
        raise
    except KeyError as e:
        raise HFConversionError(f"{path}: {arch} config lacks the field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:  # e.g. "num_attention_heads": "six"
        raise HFConversionError(f"{path}: {arch} config holds a value of the wrong type ({e})") from e
    raise HFConversionError(
        f"{path}: architecture {arch!r} is not supported; supported: {list(SUPPORTED)}; "
        f"not supported: {sorted(NOT_SUPPORTED)}"
    )


def llama3_inv_freq(kv_channels: int, rotary_percent: float, theta: float, scaling: dict[str, float]) -> torch.Tensor:
    """Llama 3.1 RoPE inverse frequencies with explicit low/high frequency factors and original length."""
    from megatron_core.models.common.embeddings.rotary_pos_embedding import _llama3_scaled_inv_freq

    dim = int(kv_channels * rotary_percent)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return _llama3_scaled_inv_freq(
        inv_freq, scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
        scaling["original_max_position_embeddings"],
    )

