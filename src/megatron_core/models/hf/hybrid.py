"""Hybrid Mamba models of Hugging Face -> HybridModel: ``NemotronHForCausalLM`` and ``Mamba2ForCausalLM``.

Both map onto :class:`~megatron_core.models.hybrid.HybridModel` (Megatron-Core's hybrid model) built from
:data:`~megatron_core.models.hybrid.hybrid_layer_specs.hybrid_stack_spec`:

- the layer pattern comes from ``layers_block_type`` (transformers 5) or ``hybrid_override_pattern`` (older
  configs): ``M`` Mamba-2 mixer, ``*`` attention (GQA, no RoPE), ``-`` MLP (squared ReLU, not gated); a
  ``Mamba2ForCausalLM`` is ``M`` repeated;
- HF tensor names start with ``backbone.`` (NVIDIA's files, and what transformers 5 saves) or ``model.``
  (NemotronH's in-memory module names); export writes the prefix it read;
- each HF layer is ``norm`` + ``mixer``; the norm becomes the Megatron layer's ``norm`` (Mamba),
  ``input_layernorm`` (attention) or ``pre_mlp_layernorm`` (MLP);
- the mixer's ``in_proj`` rows ``[z, x, B, C, dt]`` and its convolution over ``[x, B, C]`` are TP-split per
  section (:class:`~megatron_core.models.hf.rules.SectionedRows`); ``A_log``, ``D``, ``dt_bias`` and the gated
  norm's weight split by heads / groups (whole groups per rank), ``out_proj`` by columns;
- the convolution width and the SSD chunk size are the mixer's constructor arguments, so they travel in the
  layer spec (:func:`hybrid_stack_spec_for`).

Every config field that would change the computation and that the model cannot express raises
:class:`HFConversionError` naming ``config.json``, the field and its value. Fields that only steer
initialisation (``rescale_prenorm_residual``, ``time_step_min/max/floor``, ``initializer_range``) or only the
rounding of half-precision runs (``residual_in_fp32``) are accepted and ignored; see ``docs/hf_conversion.md``.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from megatron_core.activations import squared_relu
from megatron_core.models.hf.rules import Copy, FusedQKV, ModelDtypeCopy, SectionedRows, WeightRule
from megatron_core.models.hf.safetensors_io import HFConversionError

__all__ = ["hybrid_stack_spec_for", "mamba2_family_parts", "nemotron_h_family_parts"]

# transformers' layer type names (and their legacy spellings) -> hybrid pattern symbols
_LAYER_SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                  "moe": "E"}
# The Mamba mixer's gated RMSNorm has this epsilon (Megatron-Core's MambaMixer hard-codes it)
_MIXER_NORM_EPS = 1e-5


def _reject(path: str, cfg: dict, name: str, bad: bool, why: str) -> None:
    if bad:
        raise HFConversionError(f"{path}: {name}={cfg.get(name)!r} is not supported ({why})")


def _first(cfg: dict, *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _as_float(value: Any) -> float:
    """A float from config.json, where transformers writes infinity as ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def nemotron_h_pattern(path: str, cfg: dict) -> str:
    """The hybrid layer pattern (``M``, ``*``, ``-``) of a NemotronH config."""
    types = _first(cfg, "layers_block_type", "layer_types")
    if types is not None:
        if not isinstance(types, list) or any(t not in _LAYER_SYMBOLS for t in types):
            raise HFConversionError(f"{path}: layers_block_type={types!r} must be a list of "
                                    f"{sorted(_LAYER_SYMBOLS)}")
        pattern, field = "".join(_LAYER_SYMBOLS[t] for t in types), "layers_block_type"
    elif cfg.get("hybrid_override_pattern") is not None:
        pattern, field = str(cfg["hybrid_override_pattern"]), "hybrid_override_pattern"
        if not pattern or set(pattern) - set("M*-E"):
            raise HFConversionError(f"{path}: hybrid_override_pattern={pattern!r} must be made of 'M', '*', '-' "
                                    "and 'E'")
    else:
        raise HFConversionError(f"{path}: NemotronHForCausalLM config lacks both layers_block_type and "
                                "hybrid_override_pattern")
    if "E" in pattern:
        raise HFConversionError(f"{path}: {field}={cfg[field]!r} has mixture-of-experts ('moe' / 'E') layers, "
                                "which the bridge does not convert (NemotronH's latent, non-gated experts); "
                                "only Mamba, attention and MLP layers")
    return pattern


def _mamba_checks(path: str, cfg: dict, act_field: str, bias_fields: tuple[str, ...]) -> None:
    """Refusals shared by the Mamba layers of both architectures."""
    _reject(path, cfg, act_field, cfg.get(act_field, "silu") != "silu", "the Mamba mixer's activation is SiLU")
    for name in bias_fields:
        _reject(path, cfg, name, bool(cfg.get(name)), "the Mamba mixer's projections have no bias")
    conv_bias = _first(cfg, "use_conv_bias", "mamba_conv_bias", default=True)
    if not conv_bias:
        raise HFConversionError(f"{path}: use_conv_bias={conv_bias!r} is not supported (the Mamba mixer's "
                                "convolution always has a bias)")
    eps = float(_first(cfg, "layer_norm_epsilon", default=1e-5))
    if not math.isclose(eps, _MIXER_NORM_EPS, rel_tol=0, abs_tol=1e-12):
        raise HFConversionError(f"{path}: layer_norm_epsilon={eps!r} is not supported in a model with Mamba layers "
                                f"(the mixer's gated RMSNorm uses {_MIXER_NORM_EPS}, as in Megatron-Core)")


def _mamba_fields(path: str, cfg: dict, heads: int, head_dim: int, groups: int, state: int) -> dict[str, Any]:
    for name, value in (("mamba heads", heads), ("mamba head dim", head_dim), ("n_groups", groups),
                        ("ssm state size", state)):
        if value <= 0:
            raise HFConversionError(f"{path}: {name} is {value}; it must be positive")
    if heads % groups:
        raise HFConversionError(f"{path}: the Mamba heads ({heads}) must be divisible by n_groups ({groups})")
    return dict(mamba_num_heads=heads, mamba_head_dim=head_dim, mamba_num_groups=groups, mamba_state_dim=state)


def _mixer_params(path: str, cfg: dict, default_chunk: int) -> dict[str, int]:
    kernel = int(_first(cfg, "conv_kernel", "mamba_d_conv", default=4))
    chunk = int(_first(cfg, "chunk_size", "mamba_chunk_size", default=default_chunk))
    if kernel <= 0 or chunk <= 0:
        raise HFConversionError(f"{path}: conv_kernel ({kernel}) and chunk_size ({chunk}) must be positive")
    return dict(d_conv=kernel, chunk_size=chunk)


def _mamba_rules(hf_layer: str, config: dict[str, Any]) -> list[WeightRule]:
    """Rules of one Mamba layer (``hf_layer`` is the HF prefix with ``{i}``)."""
    d_inner = config["mamba_num_heads"] * config["mamba_head_dim"]
    bc = config["mamba_num_groups"] * config["mamba_state_dim"]
    ours, mixer = "decoder.layers.{i}.", hf_layer + "mixer."
    return [
        Copy(ours + "norm.weight", hf=hf_layer + "norm.weight"),
        SectionedRows(ours + "mixer.in_proj.weight", hf=mixer + "in_proj.weight",
                      sections=(d_inner, d_inner, bc, bc, config["mamba_num_heads"])),
        SectionedRows(ours + "mixer.conv1d_weight", hf=mixer + "conv1d.weight", sections=(d_inner, bc, bc)),
        SectionedRows(ours + "mixer.conv1d_bias", hf=mixer + "conv1d.bias", sections=(d_inner, bc, bc)),
        Copy(ours + "mixer.dt_bias", hf=mixer + "dt_bias", tp_axis=0),
        # kept in fp32 by the mixer (Megatron-Core's choice), written back in the model's dtype
        *(ModelDtypeCopy(ours + f"mixer.{p}", hf=mixer + p, tp_axis=0) for p in ("A_log", "D")),
        Copy(ours + "mixer.norm.weight", hf=mixer + "norm.weight", tp_axis=0),
        Copy(ours + "mixer.out_proj.weight", hf=mixer + "out_proj.weight", tp_axis=1),
    ]


def _global_rules(prefix: str, tied: bool) -> list[WeightRule]:
    embed = prefix + "embeddings.weight"
    return [
        Copy("embedding.word_embeddings.weight", hf=embed, tp_axis=0, vocab=True),
        Copy("decoder.final_norm.weight", hf=prefix + "norm_f.weight"),
        Copy("output_layer.weight", hf=embed if tied else "lm_head.weight", tp_axis=0, vocab=True),
    ]


def nemotron_h_family_parts(path: str, cfg: dict, prefix: str = "backbone.") -> dict[str, Any]:
    """Config fields, model arguments, mixer arguments and weight rules of a ``NemotronHForCausalLM`` config.

    ``prefix`` starts the HF tensor names: ``backbone.`` in NVIDIA's files and in what transformers 5 saves,
    ``model.`` in the module names transformers uses in memory (both load)."""
    pattern = nemotron_h_pattern(path, cfg)
    act = cfg.get("mlp_hidden_act", "relu2")
    _reject(path, cfg, "mlp_hidden_act", act != "relu2", "the MLP layers use squared ReLU ('relu2')")
    for name in ("attention_bias", "mlp_bias"):
        _reject(path, cfg, name, bool(cfg.get(name)), "HybridModel's linears have no bias here")
    _reject(path, cfg, "num_nextn_predict_layers", int(cfg.get("num_nextn_predict_layers") or 0) > 0,
            "HybridModel has no multi-token-prediction layers in this library")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    config: dict[str, Any] = dict(
        num_layers=len(pattern), hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=int(_first(cfg, "num_key_value_heads", default=heads)),
        kv_channels=int(_first(cfg, "head_dim", default=hidden // heads)),
        ffn_hidden_size=int(cfg["intermediate_size"]), gated_linear_unit=False, activation_func=squared_relu,
        normalization="RMSNorm",
        layernorm_epsilon=float(_first(cfg, "layer_norm_epsilon", default=1e-5)), add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=float(cfg.get("attention_dropout") or 0.0),
    )
    mixer: dict[str, int] = {}
    if "M" in pattern:
        _mamba_checks(path, cfg, "mamba_hidden_act", ("use_bias", "mamba_proj_bias"))
        config.update(_mamba_fields(path, cfg, int(cfg["mamba_num_heads"]), int(cfg["mamba_head_dim"]),
                                    int(_first(cfg, "n_groups", "mamba_n_groups", default=8)),
                                    int(cfg["ssm_state_size"])))
        mixer = _mixer_params(path, cfg, 128)
    layer = prefix + "layers.{i}."
    qkv = dict(num_heads=heads, num_groups=config["num_query_groups"], head_dim=config["kv_channels"])
    attention: list[WeightRule] = [
        Copy("decoder.layers.{i}.input_layernorm.weight", hf=layer + "norm.weight"),
        FusedQKV("decoder.layers.{i}.self_attention.linear_qkv.weight",
                 parts=tuple(layer + f"mixer.{p}_proj.weight" for p in "qkv"), **qkv),
        Copy("decoder.layers.{i}.self_attention.linear_proj.weight", hf=layer + "mixer.o_proj.weight", tp_axis=1),
    ]
    mlp: list[WeightRule] = [
        Copy("decoder.layers.{i}.pre_mlp_layernorm.weight", hf=layer + "norm.weight"),
        Copy("decoder.layers.{i}.mlp.linear_fc1.weight", hf=layer + "mixer.up_proj.weight", tp_axis=0),
        Copy("decoder.layers.{i}.mlp.linear_fc2.weight", hf=layer + "mixer.down_proj.weight", tp_axis=1),
    ]
    by_symbol = {"*": attention, "-": mlp, "M": _mamba_rules(layer, config) if "M" in pattern else []}
    # transformers' NemotronH never ties lm_head to the embeddings (whatever tie_word_embeddings says): always read it
    tied = False
    return dict(config_kwargs=config, pattern=pattern, mixer_params=mixer, by_symbol=by_symbol,
                global_rules=_global_rules(prefix, tied), tied=tied,
                max_sequence_length=int(_first(cfg, "max_position_embeddings", default=4096)))


def mamba2_family_parts(path: str, cfg: dict) -> dict[str, Any]:
    """Config fields, model arguments, mixer arguments and weight rules of a ``Mamba2ForCausalLM`` config."""
    _mamba_checks(path, cfg, "hidden_act", ("use_bias",))
    limit = cfg.get("time_step_limit")
    if limit is not None and [_as_float(v) for v in limit] != [0.0, math.inf]:
        raise HFConversionError(f"{path}: time_step_limit={limit!r} is not supported (the Mamba mixer does not "
                                "clamp the time step; only (0.0, inf))")
    _reject(path, cfg, "norm_before_gate", bool(cfg.get("norm_before_gate")),
            "the mixer gates before its norm, as in Megatron-Core")
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads, head_dim = int(cfg["num_heads"]), int(cfg["head_dim"])
    expand = cfg.get("expand", 2)
    if heads * head_dim != int(expand * hidden):
        raise HFConversionError(f"{path}: num_heads * head_dim ({heads} * {head_dim}) must equal expand * "
                                f"hidden_size ({expand} * {hidden})")
    config: dict[str, Any] = dict(
        # no attention layer: the attention fields only have to pass TransformerConfig's checks at any TP size
        # that splits the Mamba heads, so they repeat the Mamba head count and width
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, kv_channels=head_dim,
        ffn_hidden_size=4 * hidden,
        normalization="RMSNorm", layernorm_epsilon=float(_first(cfg, "layer_norm_epsilon", default=1e-5)),
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        **_mamba_fields(path, cfg, heads, head_dim, int(cfg.get("n_groups", 8)), int(cfg["state_size"])),
    )
    tied = bool(cfg.get("tie_word_embeddings", False))
    return dict(config_kwargs=config, pattern="M" * layers, mixer_params=_mixer_params(path, cfg, 256),
                by_symbol={"M": _mamba_rules("backbone.layers.{i}.", config)},
                global_rules=_global_rules("backbone.", tied), tied=tied, max_sequence_length=4096)


def hybrid_stack_spec_for(mixer_params: dict[str, Any]) -> Any:
    """:data:`hybrid_stack_spec` whose Mamba mixers take ``mixer_params`` (``d_conv``, ``chunk_size``)."""
    from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    spec = copy.deepcopy(hybrid_stack_spec)
    mixer = spec.submodules.mamba_layer.submodules.mixer
    mixer.params = {**mixer.params, **mixer_params}
    return spec
