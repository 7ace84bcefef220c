"""``TransformerConfig``'s fine-grained activation offloading fields: Megatron-Core 0.19's rules and ours."""

from __future__ import annotations

import pytest

from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.activation_offload_validation import OFFLOAD_MODULES

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)


def _config(**fields) -> TransformerConfig:
    return TransformerConfig(**BASE, **fields)


def test_defaults_match_megatron_core():
    cfg = _config()
    assert cfg.fine_grained_activation_offloading is False and cfg.offload_modules == []
    assert cfg.min_offloaded_tensor_size == 1024 * 1024 and cfg.activation_offload_fraction == 1.0
    assert cfg.delta_offload_bytes_across_pp_ranks == 0 and cfg.delay_offload_until_cuda_graph is False
    assert cfg.fine_grained_offloading_max_inflight_offloads is None
    # The settings are not checked while offloading is off (as in Megatron-Core).
    _config(offload_modules=["nonsense"], activation_offload_fraction=3.0)


def test_every_dense_and_moe_module_is_accepted():
    modules = [m for m in OFFLOAD_MODULES if m != "fused_group_mlp"]
    cfg = _config(fine_grained_activation_offloading=True, offload_modules=modules, num_moe_experts=4,
                  moe_ffn_hidden_size=32, activation_offload_fraction=0.5, fine_grained_offloading_max_inflight_offloads=0)
    assert cfg.offload_modules == modules


@pytest.mark.parametrize("fields,message", [
    (dict(offload_modules=[]), r"offload_modules \(\[\]\) must name at least one module"),
    (dict(offload_modules=None), r"offload_modules \(None\) must name at least one module"),
    (dict(offload_modules=["core_attn", "mlp"]), r"offload_modules \['mlp'\] not in the allowed set"),
    (dict(offload_modules=["attn_proj"]), r"names 'attn_proj' without 'core_attn'"),
    (dict(offload_modules=["core_attn"], cpu_offloading=True), "cannot be combined with cpu_offloading=True"),
    (dict(offload_modules=["core_attn"], min_offloaded_tensor_size=-1), r"min_offloaded_tensor_size \(-1\) must be >= 0"),
    (dict(offload_modules=["core_attn"], activation_offload_fraction=1.5),
     r"activation_offload_fraction \(1.5\) must be in \[0, 1\]"),
    (dict(offload_modules=["core_attn"], delta_offload_bytes_across_pp_ranks=-4),
     r"delta_offload_bytes_across_pp_ranks \(-4\) must be >= 0"),
    (dict(offload_modules=["core_attn"], fine_grained_offloading_max_inflight_offloads=-1),
     r"fine_grained_offloading_max_inflight_offloads \(-1\) must be None or >= 0"),
    (dict(offload_modules=["fused_group_mlp"]), "requires use_transformer_engine_op_fuser=True"),
    (dict(offload_modules=["fused_group_mlp", "moe_act"]), r"cannot be combined with \['moe_act'\]"),
    (dict(offload_modules=["core_attn"], recompute_granularity="full", recompute_method="uniform",
          recompute_num_layers=1), "recompute_granularity='full'"),
    (dict(offload_modules=["expert_fc1", "core_attn"], num_moe_experts=4, moe_ffn_hidden_size=32,
          recompute_granularity="selective", recompute_modules=["moe"]),
     r"offload_modules \['expert_fc1'\] cannot be offloaded while recompute_modules"),
    (dict(offload_modules=["core_attn"], cuda_graph_impl="local"), "cannot be combined with cuda_graph_impl='local'"),
])
def test_invalid_settings_raise(fields, message):
    with pytest.raises(ValueError, match=message):
        _config(fine_grained_activation_offloading=True, **fields)


def test_the_feature_is_no_longer_refused():
    from megatron_core.megatron_only_fields import MegatronOnlyTransformerFields

    names = {f for f in MegatronOnlyTransformerFields.__dataclass_fields__}
    assert not names & {"fine_grained_activation_offloading", "offload_modules", "min_offloaded_tensor_size",
                        "activation_offload_fraction", "fine_grained_offloading_max_inflight_offloads"}
