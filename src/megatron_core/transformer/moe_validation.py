"""Validation of ``TransformerConfig``'s mixture-of-experts fields (Megatron-Core's MoE checks).

Called from ``TransformerConfig.__post_init__``. Each rule raises a ``ValueError`` that names the
fields, their values and the rule. The checks that need process groups (the expert-parallel size
dividing ``num_moe_experts``) also run in ``MoELayer`` against the real group sizes.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
MOE_DISPATCHERS = ("allgather", "alltoall")
MOE_DROP_POLICIES = ("probs", "position")
MOE_ROUTER_DTYPES = (None, "fp32", "fp64")
_CAPACITY_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
# Types that choose the experts themselves (not balance losses): a single string only.
_SELECTION_BALANCING_TYPES = ("sinkhorn", "quantile_balancing")


def _choice(cfg: Any, name: str, allowed: tuple) -> None:
    value = getattr(cfg, name)
    if value not in allowed:
        raise ValueError(f"{name} ({value!r}) must be one of {list(allowed)}")


def _balancing_types(cfg: Any) -> list[str]:
    kind = cfg.moe_router_load_balancing_type
    kinds = list(kind) if isinstance(kind, (list, tuple)) else [kind]
    for k in kinds:
        if k not in MOE_LOAD_BALANCING_TYPES:
            raise ValueError(
                f"moe_router_load_balancing_type ({kind!r}) must be one of {list(MOE_LOAD_BALANCING_TYPES)} or a list"
            )
    if isinstance(kind, (list, tuple)):
        coeff = cfg.moe_aux_loss_coeff
        if not isinstance(coeff, (list, tuple)) or len(coeff) != len(kind):
            raise ValueError(
                f"moe_aux_loss_coeff ({coeff!r}) must be a list as long as moe_router_load_balancing_type ({kind!r})"
            )
        selecting = [k for k in kinds if k in _SELECTION_BALANCING_TYPES]
        if selecting:
            raise ValueError(
                f"moe_router_load_balancing_type ({kind!r}): {selecting} choose the experts themselves and must be "
                "given alone, as a string (a list combines balance losses)"
            )
    return kinds


def _check_selection_balancing(cfg: Any) -> None:
    """Rules of the Sinkhorn and quantile-balancing routers (Megatron-Core's router assertions)."""
    kind = cfg.moe_router_load_balancing_type
    if kind not in _SELECTION_BALANCING_TYPES:
        return
    if cfg.moe_aux_loss_coeff != 0:
        raise ValueError(
            f"moe_router_load_balancing_type={kind!r} balances without an auxiliary loss: moe_aux_loss_coeff "
            f"({cfg.moe_aux_loss_coeff!r}) must be 0"
        )
    if kind != "quantile_balancing":
        return
    if cfg.moe_router_fusion:
        raise ValueError("moe_router_load_balancing_type='quantile_balancing' does not support moe_router_fusion=True")
    if cfg.moe_router_num_groups is not None or cfg.moe_router_group_topk is not None:
        raise ValueError(
            "moe_router_load_balancing_type='quantile_balancing' does not support group-limited routing "
            f"(moe_router_num_groups={cfg.moe_router_num_groups}, moe_router_group_topk={cfg.moe_router_group_topk})"
        )
    if cfg.moe_router_topk >= cfg.num_moe_experts:
        raise ValueError(
            f"moe_router_load_balancing_type='quantile_balancing' needs moe_router_topk ({cfg.moe_router_topk}) < "
            f"num_moe_experts ({cfg.num_moe_experts}): with every expert chosen there is nothing to balance"
        )
    ema = cfg.moe_router_quantile_balancing_ema
    if not 0.0 <= ema <= 1.0:
        raise ValueError(f"moe_router_quantile_balancing_ema ({ema}) must be in [0, 1]")


def _check_layer_freq(cfg: Any) -> None:
    freq = cfg.moe_layer_freq
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq ({freq}) must be >= 1 (one MoE layer every moe_layer_freq layers)")
        return
    if not isinstance(freq, (list, tuple)) or any(v not in (0, 1) for v in freq):
        raise ValueError(f"moe_layer_freq ({freq!r}) must be an int or a list of 0 (dense) / 1 (MoE) per layer")
    if len(freq) != cfg.num_layers:
        raise ValueError(f"moe_layer_freq has {len(freq)} entries but num_layers is {cfg.num_layers}")


def _check_router(cfg: Any) -> None:
    experts, topk = cfg.num_moe_experts, cfg.moe_router_topk
    if not isinstance(topk, int) or not 1 <= topk <= experts:
        raise ValueError(f"moe_router_topk ({topk}) must be in [1, num_moe_experts ({experts})]")
    _choice(cfg, "moe_router_score_function", MOE_SCORE_FUNCTIONS)
    _choice(cfg, "moe_router_dtype", MOE_ROUTER_DTYPES)
    groups, group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ValueError(
            f"moe_router_num_groups ({groups}) and moe_router_group_topk ({group_topk}) must be set together"
        )
    if groups is not None:
        if groups <= 0 or experts % groups != 0:
            raise ValueError(f"num_moe_experts ({experts}) must be divisible by moe_router_num_groups ({groups})")
        if not 1 <= group_topk <= groups or topk % group_topk != 0 or topk // group_topk > experts // groups:
            raise ValueError(
                f"moe_router_group_topk ({group_topk}) must be in [1, moe_router_num_groups ({groups})], divide "
                f"moe_router_topk ({topk}), and moe_router_topk / moe_router_group_topk must not exceed the "
                f"experts per group ({experts // groups})"
            )
    if cfg.moe_router_enable_expert_bias and cfg.moe_router_score_function not in ("sigmoid", "sqrtsoftplus"):
        raise ValueError(
            "moe_router_enable_expert_bias=True needs moe_router_score_function 'sigmoid' or 'sqrtsoftplus' "
            f"(got {cfg.moe_router_score_function!r})"
        )
    if cfg.moe_router_bias_update_rate < 0:
        raise ValueError(f"moe_router_bias_update_rate ({cfg.moe_router_bias_update_rate}) must be >= 0")
    if cfg.moe_input_jitter_eps is not None and not 0 < cfg.moe_input_jitter_eps < 1:
        raise ValueError(f"moe_input_jitter_eps ({cfg.moe_input_jitter_eps}) must be in (0, 1)")


def _check_capacity(cfg: Any, kinds: list[str]) -> None:
    factor = cfg.moe_expert_capacity_factor
    if factor is not None and factor < 0:
        cfg.moe_expert_capacity_factor = factor = None  # Megatron-Core: a negative factor means dropless
    if factor is not None:
        bad = [k for k in kinds if k not in _CAPACITY_BALANCING_TYPES]
        if bad:
            raise ValueError(
                f"moe_expert_capacity_factor ({factor}) only works with moe_router_load_balancing_type in "
                f"{list(_CAPACITY_BALANCING_TYPES)} (got {bad})"
            )
    if cfg.moe_pad_expert_input_to_capacity and factor is None:
        raise ValueError(
            "moe_pad_expert_input_to_capacity=True needs moe_expert_capacity_factor to be set (token dropping); "
            "dropless dispatch (moe_expert_capacity_factor=None) has no capacity to pad to"
        )
    _choice(cfg, "moe_token_drop_policy", MOE_DROP_POLICIES)


MOE_FLEX_BACKENDS = ("deepep", "hybridep", "ncclep")


def apply_deprecated_moe_aliases(cfg: Any) -> None:
    """Map Megatron-Core's deprecated MoE fields onto their replacements (before the recompute rules run).

    ``moe_layer_recompute`` -> selective recompute of the ``"moe"`` module; ``moe_router_topk_limited_devices``
    -> group-limited routing over the expert-parallel ranks; ``moe_router_padding_for_fp8`` ->
    ``moe_router_padding_for_quantization``. Each warns, as Megatron-Core does.
    """
    if cfg.moe_layer_recompute:
        warnings.warn("moe_layer_recompute is deprecated; use recompute_granularity='selective' with 'moe' in "
                      "recompute_modules", DeprecationWarning, stacklevel=3)
        if cfg.recompute_granularity == "full":
            raise ValueError("moe_layer_recompute=True cannot be combined with recompute_granularity='full'")
        cfg.recompute_granularity = "selective"
        if "moe" not in cfg.recompute_modules:
            cfg.recompute_modules = [*cfg.recompute_modules, "moe"]
    limited = cfg.moe_router_topk_limited_devices
    if limited:
        if cfg.moe_router_group_topk:
            raise ValueError(
                f"moe_router_topk_limited_devices ({limited}) is deprecated and replaced by moe_router_group_topk "
                f"({cfg.moe_router_group_topk}) and moe_router_num_groups: set only the new fields"
            )
        warnings.warn("moe_router_topk_limited_devices is deprecated; use moe_router_group_topk and "
                      "moe_router_num_groups", DeprecationWarning, stacklevel=3)
        cfg.moe_router_group_topk = limited
        cfg.moe_router_num_groups = cfg.expert_model_parallel_size
    if cfg.moe_router_padding_for_fp8:
        warnings.warn("moe_router_padding_for_fp8 is deprecated; use moe_router_padding_for_quantization",
                      DeprecationWarning, stacklevel=3)
        cfg.moe_router_padding_for_quantization = True


def _check_routing_overrides(cfg: Any) -> None:
    if cfg.moe_router_padding_for_quantization:
        if cfg.fp8 is None:
            raise ValueError("moe_router_padding_for_quantization=True needs fp8 to be set (it pads each expert's "
                             "token count to the FP8 GEMMs' row alignment)")
        if cfg.moe_token_dispatcher_type != "alltoall":
            raise ValueError("moe_router_padding_for_quantization=True needs moe_token_dispatcher_type='alltoall' "
                             f"(got {cfg.moe_token_dispatcher_type!r}), as in Megatron-Core")
    biased = cfg.moe_router_force_biased
    if biased is not None and (isinstance(biased, bool) or not isinstance(biased, (int, float))
                               or not math.isfinite(biased) or biased == 0):
        raise ValueError(f"moe_router_force_biased ({biased!r}) must be None or a finite non-zero std (negative: "
                         "drawn once per layer)")


def check_moe_config(cfg: Any) -> None:
    """Validate the MoE fields of ``cfg`` (a ``TransformerConfig``) and fill ``moe_ffn_hidden_size``."""
    _choice(cfg, "moe_flex_dispatcher_backend", MOE_FLEX_BACKENDS)
    if cfg.num_moe_experts is None:
        if cfg.expert_model_parallel_size > 1:
            raise ValueError(
                f"expert_model_parallel_size ({cfg.expert_model_parallel_size}) > 1 needs num_moe_experts to be set"
            )
        return
    experts = cfg.num_moe_experts
    if not isinstance(experts, int) or experts <= 0:
        raise ValueError(f"num_moe_experts ({experts!r}) must be a positive integer")
    if experts % cfg.expert_model_parallel_size != 0:
        raise ValueError(
            f"num_moe_experts ({experts}) must be divisible by expert_model_parallel_size "
            f"({cfg.expert_model_parallel_size})"
        )
    if cfg.moe_ffn_hidden_size is None:
        cfg.moe_ffn_hidden_size = cfg.ffn_hidden_size
    etp = cfg.expert_tensor_parallel_size
    if cfg.moe_ffn_hidden_size % etp != 0:
        raise ValueError(
            f"moe_ffn_hidden_size ({cfg.moe_ffn_hidden_size}) must be divisible by expert_tensor_parallel_size ({etp})"
        )
    if cfg.add_bias_linear and etp > 1:
        raise ValueError(
            f"expert biases (add_bias_linear=True) need expert_tensor_parallel_size 1 (got {etp}), as in Megatron-Core"
        )
    _check_layer_freq(cfg)
    _check_router(cfg)
    _check_capacity(cfg, _balancing_types(cfg))
    _check_selection_balancing(cfg)
    _choice(cfg, "moe_token_dispatcher_type", MOE_DISPATCHERS)
    _check_routing_overrides(cfg)
    if cfg.moe_latent_size is not None and cfg.moe_latent_size <= 0:
        raise ValueError(f"moe_latent_size ({cfg.moe_latent_size}) must be > 0 (or None: no latent projections)")
    shared = cfg.moe_shared_expert_intermediate_size
    if shared is not None and shared <= 0:
        raise ValueError(f"moe_shared_expert_intermediate_size ({shared}) must be > 0")
    if cfg.moe_shared_expert_overlap and cfg.moe_token_dispatcher_type != "alltoall":
        raise ValueError(
            "moe_shared_expert_overlap=True only works with moe_token_dispatcher_type='alltoall' "
            f"(got {cfg.moe_token_dispatcher_type!r})"
        )
    # moe_router_fusion / moe_permute_fusion choose Transformer Engine kernels with the same maths: accepted, no
    # effect (the PyTorch routing and permutation run); their combination rules are checked above.


class EPOverlapConfigError(ValueError, AssertionError):
    """A setting that ``overlap_moe_expert_parallel_comm`` cannot run with (an ``AssertionError`` too, as in
    Megatron-Core)."""


def _check_delayed_wgrad(cfg: Any) -> None:
    """Megatron-Core's rules for the deferred weight gradients (``tensor_parallel.delayed_wgrad``)."""
    if cfg.delay_wgrad_compute and not cfg.overlap_moe_expert_parallel_comm:
        raise EPOverlapConfigError("delay_wgrad_compute=True needs overlap_moe_expert_parallel_comm=True (the combined "
                                   "1F1B schedule runs the deferred weight gradients)")
    if cfg.overlap_dispatch_backward_with_experts_wgrad:
        if cfg.overlap_moe_expert_parallel_comm:
            raise EPOverlapConfigError("overlap_dispatch_backward_with_experts_wgrad=True needs "
                                       "overlap_moe_expert_parallel_comm=False")
        if cfg.delay_wgrad_compute:
            raise EPOverlapConfigError("delay_wgrad_compute=True and overlap_dispatch_backward_with_experts_wgrad=True "
                                       "are mutually exclusive: set only one")


def check_ep_overlap(cfg: Any) -> None:
    """Megatron-Core's rules for ``overlap_moe_expert_parallel_comm`` (the combined 1F1B schedule of
    ``pipeline_parallel.combined_1f1b``) and for ``ep_overlap_early_attn_memory_release``, which needs it."""
    if cfg.ep_overlap_early_attn_memory_release and not cfg.overlap_moe_expert_parallel_comm:
        raise EPOverlapConfigError("ep_overlap_early_attn_memory_release=True needs overlap_moe_expert_parallel_comm=True")
    _check_delayed_wgrad(cfg)
    if not cfg.overlap_moe_expert_parallel_comm:
        return
    rules = [
        (cfg.pipeline_model_parallel_size == 1 or cfg.virtual_pipeline_model_parallel_size is not None,
         "virtual_pipeline_model_parallel_size must be set when pipeline_model_parallel_size > 1"),
        (cfg.expert_model_parallel_size > 1, "it needs expert model parallelism (expert_model_parallel_size > 1)"),
        (cfg.moe_token_dispatcher_type in ("alltoall", "flex"), "it needs the alltoall or flex token dispatcher"),
        (cfg.recompute_granularity != "full", "disable full recomputation"),
        (cfg.recompute_method is None, "recompute_method must be None"),
        (cfg.recompute_num_layers is None, "recompute_num_layers must be None"),
        ("moe" not in (cfg.recompute_modules or []), "remove 'moe' from recompute_modules"),
        (cfg.bf16 or cfg.fp16, "it needs a bf16 or fp16 model"),
        (not cfg.moe_shared_expert_overlap, "disable moe_shared_expert_overlap"),
        (cfg.mtp_num_layers in (None, 0, 1), "MTP supports at most one layer"),
    ]
    for ok, rule in rules:
        if not ok:
            raise EPOverlapConfigError(f"overlap_moe_expert_parallel_comm=True: {rule}")
