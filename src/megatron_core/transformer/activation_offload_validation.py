"""The rules of ``TransformerConfig``'s fine-grained activation offloading fields (Megatron-Core 0.19's).

Checked only with ``fine_grained_activation_offloading=True``; each error names the fields, their values and
the rule. Two rules are this library's own: full-layer recompute is refused (the recomputed forward runs
inside the backward pass, where offload groups cannot open), and so are CUDA graphs (Megatron-Core offloads
only around Transformer Engine's partial-layer graphs; ``cuda_graph_impl='local'`` here records whole layers,
which Megatron-Core refuses too).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MOE_OFFLOAD_MODULES", "OFFLOAD_MODULES", "check_fine_grained_activation_offloading"]

OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
                   "fused_group_mlp")
"""What ``offload_modules`` may name: the module whose saved activations move to host memory."""

MOE_OFFLOAD_MODULES = ("expert_fc1", "moe_act", "fused_group_mlp")
"""The offload modules inside a MoE layer's experts."""


def check_fine_grained_activation_offloading(cfg: Any) -> None:
    """Validate the offloading fields of ``cfg`` (a ``TransformerConfig``) when offloading is on."""
    if not cfg.fine_grained_activation_offloading:
        return
    if cfg.cpu_offloading:
        raise ValueError("fine_grained_activation_offloading=True cannot be combined with cpu_offloading=True")
    modules = cfg.offload_modules
    if not modules:
        raise ValueError(f"offload_modules ({modules!r}) must name at least one module with "
                         f"fine_grained_activation_offloading=True; choices: {list(OFFLOAD_MODULES)}")
    unknown = sorted(set(modules) - set(OFFLOAD_MODULES))
    if unknown:
        raise ValueError(f"offload_modules {unknown} not in the allowed set {list(OFFLOAD_MODULES)}")
    if "attn_proj" in modules and "core_attn" not in modules:
        raise ValueError(f"offload_modules ({modules!r}) names 'attn_proj' without 'core_attn': attn_proj's input "
                         "is core attention's output, which core attention's backward needs too")
    _check_recompute(cfg, modules)
    _check_settings(cfg)
    if "fused_group_mlp" in modules:
        partial = sorted({"expert_fc1", "moe_act"} & set(modules))
        if partial:
            raise ValueError(f"offload_modules ({modules!r}): 'fused_group_mlp' offloads the whole fused grouped MLP "
                             f"and cannot be combined with {partial}")
        if not cfg.use_transformer_engine_op_fuser:
            raise ValueError("offload_modules 'fused_group_mlp' requires use_transformer_engine_op_fuser=True "
                             "(Transformer Engine's op fuser, which this library does not provide)")
    if cfg.cuda_graph_impl != "none":
        raise ValueError(f"fine_grained_activation_offloading=True cannot be combined with cuda_graph_impl="
                         f"{cfg.cuda_graph_impl!r}: offloading needs partial-layer Transformer Engine graphs, and "
                         "this library's 'local' graphs record whole layers")


def _check_recompute(cfg: Any, modules: list[str]) -> None:
    if cfg.recompute_granularity == "full":
        raise ValueError("fine_grained_activation_offloading=True cannot be combined with recompute_granularity="
                         "'full': the recomputed layers run inside the backward pass, where offload groups cannot "
                         "open; use selective recompute")
    if cfg.recompute_granularity == "selective" and "moe" in (cfg.recompute_modules or []):
        inside = sorted(set(MOE_OFFLOAD_MODULES) & set(modules))
        if inside:
            raise ValueError(f"offload_modules {inside} cannot be offloaded while recompute_modules "
                             f"({cfg.recompute_modules!r}) recomputes the whole MoE layer ('moe'): remove one or "
                             "the other")


def _check_settings(cfg: Any) -> None:
    if cfg.min_offloaded_tensor_size < 0:
        raise ValueError(f"min_offloaded_tensor_size ({cfg.min_offloaded_tensor_size}) must be >= 0")
    if not 0 <= cfg.activation_offload_fraction <= 1:
        raise ValueError(f"activation_offload_fraction ({cfg.activation_offload_fraction}) must be in [0, 1]")
    if cfg.delta_offload_bytes_across_pp_ranks < 0:
        raise ValueError(f"delta_offload_bytes_across_pp_ranks ({cfg.delta_offload_bytes_across_pp_ranks}) must be "
                         ">= 0")
    cap = cfg.fine_grained_offloading_max_inflight_offloads
    if cap is not None and cap < 0:
        raise ValueError(f"fine_grained_offloading_max_inflight_offloads ({cap}) must be None or >= 0")
