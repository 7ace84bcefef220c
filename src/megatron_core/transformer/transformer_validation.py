"""Validation of ``TransformerConfig`` (the checks its ``__post_init__`` runs, in that order).

Plain functions taking the config; each rule raises a ``ValueError`` that names the fields, their values and
the rule. Megatron-Core keeps these checks inside ``TransformerConfig.__post_init__``; here the dataclass
(:mod:`.transformer_config`) keeps its fields and derived defaults and calls these. MoE, MLA and muP settings
are checked in :mod:`.moe_validation`, :mod:`.mla_validation` and :mod:`.mup_config`.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch.nn.functional as F

from megatron_core.activations import quick_gelu
from megatron_core.fusions.fused_bias_geglu import quick_gelu as _fused_quick_gelu
from megatron_core.transformer.cuda_graph_config import normalize_cuda_graph_modules
from megatron_core.transformer.enums import LayerType
from megatron_core.transformer.pipeline_layout import PipelineParallelLayerLayout, chunk_layer_counts
from megatron_core.transformer.rope_utils import yarn_concentration_factor

__all__ = [
    "CUDA_GRAPH_IMPLS",
    "QUICK_GELUS",
    "RECOMPUTE_MODULES",
    "SOFTMAX_TYPES",
    "check_cuda_graphs",
    "check_fp8",
    "check_fp8_and_transformer_impl",
    "check_gpt_oss_options",
    "check_mtp",
    "check_normalization_and_activation",
    "check_parallel_shapes",
    "check_pipeline_split",
    "check_qk_clip",
    "check_recompute",
    "check_shape",
]

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
# Megatron-Core has quick_gelu in both ``activations`` and ``fusions.fused_bias_geglu``: either one is accepted.
QUICK_GELUS = (quick_gelu, _fused_quick_gelu)
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")  # Megatron-Core's names
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe_act", "moe", "shared_experts", "mla_up_proj")


def check_shape(cfg: Any) -> None:
    """Positive sizes, dropouts in [0, 1), and heads that split evenly (before the defaults are derived)."""
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} ({value!r}) must be a positive integer")
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(cfg, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} ({value}) must be in [0, 1)")
    if cfg.kv_channels is None and cfg.hidden_size % cfg.num_attention_heads != 0:
        raise ValueError(
            f"hidden_size ({cfg.hidden_size}) must be divisible by num_attention_heads ({cfg.num_attention_heads}) "
            f"when kv_channels is not set"
        )
    if cfg.num_query_groups is not None and (
        cfg.num_query_groups <= 0 or cfg.num_attention_heads % cfg.num_query_groups != 0
    ):
        raise ValueError(
            f"num_attention_heads ({cfg.num_attention_heads}) must be divisible by num_query_groups "
            f"({cfg.num_query_groups})"
        )


def check_parallel_shapes(cfg: Any) -> None:
    """Heads, query groups and the MLP width divide over tensor parallelism."""
    tp = cfg.tensor_model_parallel_size
    if cfg.num_attention_heads % tp != 0:
        raise ValueError(
            f"num_attention_heads ({cfg.num_attention_heads}) must be divisible by "
            f"tensor_model_parallel_size ({tp})"
        )
    if cfg.num_query_groups % tp != 0:
        raise ValueError(
            f"num_query_groups ({cfg.num_query_groups}) must be divisible by tensor_model_parallel_size ({tp}); "
            f"replicating key/value heads across tensor-parallel ranks is not supported"
        )
    if cfg.ffn_hidden_size % tp != 0:
        raise ValueError(f"ffn_hidden_size ({cfg.ffn_hidden_size}) must be divisible by tensor_model_parallel_size ({tp})")


def check_normalization_and_activation(cfg: Any) -> None:
    """The normalization, its epsilon, and what the fused bias-activation supports."""
    if cfg.normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization ({cfg.normalization!r}) must be 'LayerNorm' or 'RMSNorm'")
    if cfg.layernorm_epsilon <= 0:
        raise ValueError(f"layernorm_epsilon ({cfg.layernorm_epsilon}) must be > 0")
    if cfg.bias_activation_fusion:
        act = cfg.activation_func
        if act not in (F.gelu, F.silu, *QUICK_GELUS):
            raise ValueError(
                f"bias_activation_fusion=True needs activation_func F.gelu, F.silu or quick_gelu, got {act!r}"
            )
        if act in QUICK_GELUS and not cfg.gated_linear_unit:
            raise ValueError("bias_activation_fusion=True with activation_func=quick_gelu needs gated_linear_unit=True")
        if cfg.glu_linear_offset != 0.0 and act not in QUICK_GELUS:
            raise ValueError(
                f"bias_activation_fusion=True with glu_linear_offset={cfg.glu_linear_offset} needs "
                f"activation_func=quick_gelu, got {act!r}"
            )
        if act is F.gelu and not cfg.gated_linear_unit and not cfg.add_bias_linear:
            raise ValueError(
                "bias_activation_fusion=True with activation_func=F.gelu and gated_linear_unit=False needs "
                "add_bias_linear=True"
            )


TRANSFORMER_IMPLS = ("local", "transformer_engine", "inference_optimized")


def check_fp8_and_transformer_impl(cfg: Any) -> None:
    """FP8's rules, then ``transformer_impl`` (one of ``TRANSFORMER_IMPLS``)."""
    check_fp8(cfg)
    if cfg.transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl ({cfg.transformer_impl!r}) must be one of {TRANSFORMER_IMPLS}")


_FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom", "rowwise")


def check_fp8(cfg: Any) -> None:
    """Megatron-Core's FP8 rules; the recipe itself is checked by the backend that converts the model."""
    if cfg.fp8 is None:
        return
    if cfg.fp8 not in ("e4m3", "hybrid"):
        raise ValueError(f"fp8 ({cfg.fp8!r}) must be None, 'e4m3' or 'hybrid'")
    if cfg.fp8_recipe not in _FP8_RECIPES:
        raise ValueError(f"fp8_recipe ({cfg.fp8_recipe!r}) must be one of {_FP8_RECIPES}")
    if cfg.fp8_margin < 0 or cfg.fp8_amax_history_len < 1:
        raise ValueError(f"fp8_margin ({cfg.fp8_margin}) must be >= 0 and fp8_amax_history_len "
                         f"({cfg.fp8_amax_history_len}) >= 1")
    if cfg.first_last_layers_bf16:
        if cfg.fp8_recipe == "delayed":
            raise ValueError("first_last_layers_bf16=True is not supported with fp8_recipe='delayed'")
        per_stage = cfg.num_layers // cfg.pipeline_model_parallel_size
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            value = getattr(cfg, name)
            if not 0 <= value <= per_stage:
                raise ValueError(f"{name} ({value}) must be between 0 and the number of layers per pipeline "
                                 f"stage ({per_stage})")


def check_gpt_oss_options(cfg: Any) -> None:
    """Attention sinks, the offset / clamped GLU and YaRN's settings (the features of GPT-OSS)."""
    if cfg.softmax_type not in SOFTMAX_TYPES:
        raise ValueError(f"softmax_type ({cfg.softmax_type!r}) must be one of {list(SOFTMAX_TYPES)}")
    clamp = cfg.activation_func_clamp_value
    if clamp is not None and not clamp > 0:
        raise ValueError(f"activation_func_clamp_value ({clamp}) must be None or > 0")
    if (cfg.glu_linear_offset != 0.0 or clamp is not None) and not cfg.gated_linear_unit:
        raise ValueError(
            f"glu_linear_offset ({cfg.glu_linear_offset}) and activation_func_clamp_value ({clamp}) act on a gated "
            "MLP's two halves: they need gated_linear_unit=True"
        )
    for name in ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name} ({getattr(cfg, name)}) must be > 0")
    mscale = yarn_concentration_factor(cfg)
    if mscale != 1.0 and (cfg.apply_rope_fusion or cfg.fused_single_qkv_rope):
        raise ValueError(
            f"apply_rope_fusion ({cfg.apply_rope_fusion}) / fused_single_qkv_rope ({cfg.fused_single_qkv_rope}) "
            f"cannot be used with YaRN's attention scaling ({mscale:.6g}, from yarn_rotary_scaling_factor="
            f"{cfg.yarn_rotary_scaling_factor}): the fused rotary kernel does not scale; set both to False"
        )


def check_qk_clip(cfg: Any) -> None:
    """Megatron-LM's rules for QK-clip (checked on its command line there): 0 < alpha < 1, threshold > 0."""
    if not cfg.qk_clip:
        return
    alpha, threshold = cfg.qk_clip_alpha, cfg.qk_clip_threshold
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha < 1.0:
        raise ValueError(f"qk_clip_alpha ({alpha!r}) must be strictly between 0 and 1 when qk_clip=True")
    if (isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold)
            or not threshold > 0):
        raise ValueError(f"qk_clip_threshold ({threshold!r}) must be a finite number > 0 when qk_clip=True")


def check_attention_output_gate(cfg: Any) -> None:
    """Megatron-Core's rules for the gated attention output: a bool, not with multi-latent attention and not with
    ``fused_single_qkv_rope`` (its kernel splits an ungated QKV)."""
    gate = cfg.attention_output_gate
    if not isinstance(gate, bool):
        raise ValueError(f"attention_output_gate ({gate!r}) must be a bool")
    if gate and cfg.multi_latent_attention:
        raise ValueError("attention_output_gate=True is not supported with multi_latent_attention=True")
    if gate and cfg.fused_single_qkv_rope:
        raise ValueError("attention_output_gate=True is not supported with fused_single_qkv_rope=True")


def check_recompute(cfg: Any) -> None:
    """Megatron-Core's rules for activation recompute (granularity, method, layers, modules)."""
    granularity, method, num = cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers
    if granularity is None:
        if method is not None:
            raise ValueError(f"recompute_method ({method!r}) needs recompute_granularity='full'")
        return
    if granularity not in ("full", "selective"):
        raise ValueError(f"recompute_granularity ({granularity!r}) must be 'full' or 'selective'")
    if granularity == "full":
        if method not in ("uniform", "block"):
            raise ValueError(
                f"recompute_method ({method!r}) must be 'uniform' or 'block' with recompute_granularity='full'"
            )
        if num is None or num <= 0:
            raise ValueError(f"recompute_num_layers ({num}) must be > 0 with recompute_granularity='full'")
        if method == "block" and num > cfg.num_layers:
            raise ValueError(f"recompute_num_layers ({num}) must be <= num_layers ({cfg.num_layers}) with method 'block'")
    else:
        if num is not None:
            raise ValueError(f"recompute_num_layers ({num}) must be None with recompute_granularity='selective'")
        if method is not None:
            raise ValueError(f"recompute_method ({method!r}) must be None with recompute_granularity='selective'")
        unknown = sorted(set(cfg.recompute_modules) - set(RECOMPUTE_MODULES))
        if unknown:
            raise ValueError(f"recompute_modules {unknown} not in the allowed set {list(RECOMPUTE_MODULES)}")
        supported = {"core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts", "mla_up_proj"}
        unsupported = sorted(set(cfg.recompute_modules) - supported)
        if unsupported:
            raise ValueError(f"recompute_modules {unsupported} are not supported by this library (supported: "
                             f"{sorted(supported)})")
        if "mla_up_proj" in cfg.recompute_modules and not cfg.multi_latent_attention:
            raise ValueError(f"recompute_modules ({cfg.recompute_modules}) has 'mla_up_proj', which needs "
                             f"multi_latent_attention=True (got {cfg.multi_latent_attention})")
    if cfg.distribute_saved_activations and cfg.sequence_parallel:
        raise ValueError("distribute_saved_activations=True cannot be used with sequence_parallel=True")


def check_cuda_graphs(cfg: Any) -> None:
    """``cuda_graph_impl``: ``'none'``, ``'local'`` (whole layers recorded through Inductor,
    :mod:`.layer_cuda_graphs`) or ``'full_iteration'`` (:mod:`megatron_core.full_cuda_graph`, see
    :func:`_check_full_iteration`); the deprecated ``enable_cuda_graph=True`` becomes ``'local'`` with a warning, as
    in Megatron-Core. Transformer Engine's graphs, partial-layer scopes, full recompute and MoE layers (whose
    per-expert token counts change every step) are refused by name."""
    if cfg.enable_cuda_graph:
        if cfg.cuda_graph_impl != "none":
            raise ValueError(f"enable_cuda_graph=True (deprecated) cannot be combined with cuda_graph_impl="
                             f"{cfg.cuda_graph_impl!r}: set only cuda_graph_impl='local'")
        warnings.warn("enable_cuda_graph is deprecated, use cuda_graph_impl='local' instead", stacklevel=4)
        cfg.cuda_graph_impl = "local"
    impl = cfg.cuda_graph_impl
    if impl not in CUDA_GRAPH_IMPLS:
        raise ValueError(f"cuda_graph_impl ({impl!r}) must be one of {list(CUDA_GRAPH_IMPLS)}")
    if impl == "transformer_engine":
        raise ValueError("cuda_graph_impl='transformer_engine' is not provided by this library (Transformer Engine's "
                         "graphed callables); use 'local' (each TransformerLayer recorded as CUDA graphs through "
                         "torch.compile), 'full_iteration' or 'none'")
    if impl == "full_iteration":
        _check_full_iteration(cfg)
        return
    if impl != "local":
        return
    name = "cuda_graph_scope" if cfg.cuda_graph_scope is not None else "cuda_graph_modules"  # the deprecated name wins
    scopes = getattr(cfg, name)
    modules, deprecated, _ = normalize_cuda_graph_modules(scopes)
    if modules or deprecated:
        raise ValueError(f"{name} ({scopes!r}) must be 'full' or empty with cuda_graph_impl='local': this library "
                         "records whole layers, not parts of them")
    if cfg.recompute_granularity == "full":
        raise ValueError("recompute_granularity='full' cannot be used with cuda_graph_impl='local' (a recomputed "
                         "layer cannot be replayed from a graph; Megatron-Core allows it only with the "
                         "full-iteration graph)")
    if cfg.num_moe_experts is not None:
        raise ValueError(f"cuda_graph_impl='local' with num_moe_experts={cfg.num_moe_experts} is not supported: the "
                         "tokens per expert change every step, so a recorded MoE layer cannot be replayed")


def _check_full_iteration(cfg: Any) -> None:
    """``cuda_graph_impl='full_iteration'``: as in Megatron-Core, ``cuda_graph_modules`` must be empty (``'full'``
    normalises to empty). Also refused here, because the captured iteration could not run in a CUDA graph with this
    library: the RNG tracker's forks (``sequence_parallel``, ``attention_dropout``) and activation recompute swap
    generator states with ``set_rng_state``, which CUDA forbids during a capture; ``calculate_per_token_loss`` reads
    the global token count on the host in ``finalize_model_grads``. MoE layers are captured where their counts stay
    on the device (:func:`_check_full_iteration_moe`)."""
    name = "cuda_graph_scope" if cfg.cuda_graph_scope is not None else "cuda_graph_modules"
    scopes = getattr(cfg, name)
    modules, deprecated, _ = normalize_cuda_graph_modules(scopes)
    if modules or deprecated:
        raise ValueError(f"{name} ({scopes!r}) must be empty when cuda_graph_impl='full_iteration'")
    why = {
        "sequence_parallel": "its RNG-tracker fork swaps generator states, which a CUDA graph capture forbids",
        "attention_dropout": "the RNG-tracker fork around attention dropout swaps generator states, which a CUDA "
                             "graph capture forbids",
        "recompute_granularity": "recomputation saves and restores generator states, which a CUDA graph capture "
                                 "forbids",
        "calculate_per_token_loss": "finalize_model_grads reads the global token count on the host",
    }
    for field, value in (("sequence_parallel", cfg.sequence_parallel), ("attention_dropout", cfg.attention_dropout),
                         ("recompute_granularity", cfg.recompute_granularity),
                         ("calculate_per_token_loss", cfg.calculate_per_token_loss)):
        if value:
            raise ValueError(f"{field}={value!r} cannot be used with cuda_graph_impl='full_iteration': {why[field]}")
    if cfg.num_moe_experts:
        _check_full_iteration_moe(cfg)


def _check_full_iteration_moe(cfg: Any) -> None:
    """MoE under ``cuda_graph_impl='full_iteration'``: only where no tokens-per-expert count is read on the host
    (``transformer.moe.host_counts``). Each rank must hold every expert (the all-to-all's and all-gather's splits
    are host-sized otherwise), the experts must be grouped (``SequentialMLP`` splits rows by host counts) and
    either routing keeps top-k rows per token in bf16 / fp16 (the grouped kernel takes device offsets; fp32 runs
    one GEMM per expert) or every expert is padded to its capacity (shapes follow from the token count)."""
    expert_tp = cfg.expert_tensor_parallel_size or cfg.tensor_model_parallel_size
    padded = bool(cfg.moe_pad_expert_input_to_capacity)
    rules = [
        (cfg.expert_model_parallel_size * expert_tp != 1,
         f"expert_model_parallel_size={cfg.expert_model_parallel_size} x expert_tensor_parallel_size={expert_tp} "
         "must be 1 (with expert parallelism the token dispatch's collectives are sized on the host)"),
        (not cfg.moe_grouped_gemm, "moe_grouped_gemm=False: SequentialMLP splits the rows by counts read on the "
                                   "host; set moe_grouped_gemm=True"),
        (not padded and cfg.moe_expert_capacity_factor is not None,
         f"moe_expert_capacity_factor={cfg.moe_expert_capacity_factor} without moe_pad_expert_input_to_capacity "
         "drops tokens, so the row count depends on the routing"),
        (not padded and bool(cfg.moe_router_padding_for_quantization),
         "moe_router_padding_for_quantization=True makes the row count depend on the routing"),
        (not padded and not (cfg.bf16 or cfg.fp16),
         "fp32 experts (bf16=False, fp16=False) run one GEMM per expert, sized by counts read on the host; use "
         "bf16 / fp16 or moe_pad_expert_input_to_capacity=True"),
    ]
    for broken, why in rules:
        if broken:
            raise ValueError(f"num_moe_experts={cfg.num_moe_experts} with cuda_graph_impl='full_iteration': {why}")


def check_pipeline_split(cfg: Any) -> None:
    """The pipeline split settings: a layout (parsed and validated in place) or uneven stages."""
    uneven = cfg.num_layers_in_first_pipeline_stage is not None or cfg.num_layers_in_last_pipeline_stage is not None
    accounted = cfg.account_for_embedding_in_pipeline_split or cfg.account_for_loss_in_pipeline_split
    if cfg.pipeline_model_parallel_layout is not None and (uneven or accounted):
        raise ValueError(
            "pipeline_model_parallel_layout cannot be combined with num_layers_in_first/last_pipeline_stage or "
            "account_for_embedding/loss_in_pipeline_split"
        )
    if uneven and accounted:
        raise ValueError(
            "num_layers_in_first/last_pipeline_stage cannot be combined with account_for_embedding/loss_in_pipeline_split"
        )
    layout = cfg.pipeline_model_parallel_layout
    if layout is not None:
        if isinstance(layout, str):
            layout = PipelineParallelLayerLayout.from_str(layout, cfg.pipeline_model_parallel_size)
        elif not isinstance(layout, PipelineParallelLayerLayout):
            layout = PipelineParallelLayerLayout(layout, cfg.pipeline_model_parallel_size)
        vpp = layout.virtual_pipeline_model_parallel_size
        if cfg.virtual_pipeline_model_parallel_size is None and vpp > 1:
            cfg.virtual_pipeline_model_parallel_size = vpp
        cfg.pipeline_model_parallel_layout = layout
        standalone = layout.validate_layer_layout(cfg.num_layers, cfg.mtp_num_layers)
        _check_mtp_standalone(cfg, layout, standalone)
        cfg.mtp_standalone = standalone
    elif cfg.mtp_standalone:
        raise ValueError("mtp_standalone=True needs a pipeline_model_parallel_layout that puts the MTP layers on a "
                         "stage before the last pipeline rank; pipeline_model_parallel_layout is None")
    chunk_layer_counts(cfg)


def _check_mtp_standalone(cfg: Any, layout: PipelineParallelLayerLayout, standalone: bool) -> None:
    """``mtp_standalone`` as given must agree with the layout; an MTP chunk that shares the first pipeline rank
    with the embedding chunk (virtual stages) is refused."""
    if cfg.mtp_standalone and not standalone:
        raise ValueError(f"mtp_standalone=True contradicts pipeline_model_parallel_layout {layout!r}, which puts the "
                         "MTP layers on the last pipeline rank (or has none); leave mtp_standalone unset: the layout "
                         "sets it")
    if standalone and layout.virtual_pipeline_model_parallel_size > 1 and LayerType.mtp in layout.layout[0][-1]:
        raise ValueError(f"pipeline_model_parallel_layout {layout!r} puts the MTP layers on the first pipeline rank's "
                         "last virtual stage (mtp_standalone with virtual_pipeline_model_parallel_size "
                         f"{layout.virtual_pipeline_model_parallel_size}): that rank would hold the embedding and its "
                         "MTP copy in two model chunks, which cannot be synchronised over the embedding group; put "
                         "them on a middle pipeline rank")


def check_mtp(cfg: Any) -> None:
    """Multi-token prediction: a non-negative depth, and a loss scale when it is on."""
    if cfg.mtp_num_layers is not None and (not isinstance(cfg.mtp_num_layers, int) or cfg.mtp_num_layers < 0):
        raise ValueError(f"mtp_num_layers ({cfg.mtp_num_layers!r}) must be a non-negative integer (None or 0: no MTP)")
    if cfg.mtp_num_layers and cfg.mtp_loss_scaling_factor is None:
        raise ValueError(f"mtp_loss_scaling_factor must be a number with mtp_num_layers ({cfg.mtp_num_layers})")
