"""Latent MoE (``moe_latent_size``): tokens are projected to a smaller width before dispatch and back after combine.

- One MoE layer against Hugging Face's ``NemotronHMoE`` (latent projections, squared-ReLU experts, sigmoid router
  with expert bias, group-limited top-k, scaling, a shared expert on the full width) on the same weights.
- Expert and tensor parallelism against a single process (loss and the clipped step, through
  ``test_expert_parallel``'s check), both expert layouts.
- Megatron-Core's state-dict keys; a bad size is refused naming the field.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.activations import squared_relu
from megatron_core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.spec_utils import build_module
from tests.dist_harness import run_on_ranks
from tests.transformer.moe.moe_parallel_utils import build
from tests.transformer.moe.test_expert_parallel import WORLD, _check

HIDDEN, LATENT, FFN, SHARED, EXPERTS = 16, 8, 12, 20, 8


def _nemotron_moe():
    config_module = pytest.importorskip("transformers.models.nemotron_h.configuration_nemotron_h")
    modeling = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    config = config_module.NemotronHConfig(
        hidden_size=HIDDEN, moe_intermediate_size=FFN, moe_latent_size=LATENT, n_routed_experts=EXPERTS,
        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        mlp_hidden_act="relu2", moe_shared_expert_intermediate_size=SHARED, mlp_bias=False)
    torch.manual_seed(0)
    hf = modeling.NemotronHMoE(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.3)
        hf.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return hf


def _our_layer(grouped: bool):
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN, num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=FFN, moe_latent_size=LATENT, moe_router_topk=4, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=SHARED, gated_linear_unit=False,
        activation_func=squared_relu, add_bias_linear=False, moe_grouped_gemm=grouped, use_cpu_initialization=True)
    return build_module(get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=grouped),
                        config=config, layer_number=1).eval()


def _copy_hf_weights(ours, hf) -> None:
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        ours.router.expert_bias.copy_(hf.gate.e_score_correction_bias)
        ours.fc1_latent_proj.weight.copy_(hf.fc1_latent_proj.weight)
        ours.fc2_latent_proj.weight.copy_(hf.fc2_latent_proj.weight)
        ours.shared_experts.linear_fc1.weight.copy_(hf.shared_experts.up_proj.weight)
        ours.shared_experts.linear_fc2.weight.copy_(hf.shared_experts.down_proj.weight)
        if hasattr(ours.experts, "local_experts"):
            for e, expert in enumerate(ours.experts.local_experts):
                expert.linear_fc1.weight.copy_(hf.experts.up_proj[e])
                expert.linear_fc2.weight.copy_(hf.experts.down_proj[e])
        else:
            ours.experts.linear_fc1.weight.copy_(hf.experts.up_proj)
            ours.experts.linear_fc2.weight.copy_(hf.experts.down_proj)


@pytest.mark.parametrize("grouped", [False, True])
def test_latent_moe_layer_matches_hugging_face_nemotron_h(grouped: bool):
    hf = _nemotron_moe()
    ours = _our_layer(grouped)
    _copy_hf_weights(ours, hf)
    x = torch.randn(3, 5, HIDDEN)  # [b, s, h]
    with torch.no_grad():
        want = hf(x)
        got, _ = ours(x.transpose(0, 1).contiguous())
    torch.testing.assert_close(got.transpose(0, 1), want, rtol=1e-5, atol=1e-5)


def test_latent_moe_keys_and_widths_follow_megatron_core():
    model = build("mixtral", moe_latent_size=8)
    state = model.state_dict()
    assert state["decoder.layers.0.mlp.fc1_latent_proj.weight"].shape == (8, 16)
    assert state["decoder.layers.0.mlp.fc2_latent_proj.weight"].shape == (16, 8)
    assert "decoder.layers.0.mlp.fc1_latent_proj._extra_state" in state
    assert state["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"].shape == (64, 8)
    assert state["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"].shape == (8, 32)


def test_a_non_positive_latent_size_is_refused():
    with pytest.raises(ValueError, match=r"moe_latent_size \(0\) must be > 0"):
        build("mixtral", moe_latent_size=0)


# init_method_std 0.5: with the default 0.02 the latent projections' gradients (~1e-7) would sit below the
# tolerance, and a missing reduction over tensor parallelism would go unnoticed.
LATENT_CASES = [
    ("deepseek", 2, 2, 1, "alltoall", True, dict(moe_latent_size=8, init_method_std=0.5)),
    ("mixtral", 1, 4, 1, "allgather", False, dict(moe_latent_size=8, moe_grouped_gemm=True)),
]


def test_latent_moe_under_expert_and_tensor_parallelism_matches_single_process():
    results = run_on_ranks(WORLD, _check, LATENT_CASES)
    assert all(len(r) == len(LATENT_CASES) for r in results)
