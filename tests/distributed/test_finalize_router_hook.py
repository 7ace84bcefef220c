"""finalize_model_grads asks each MoE router to update its expert bias (the router owns the rule)."""

from __future__ import annotations

import torch

from megatron_core.distributed.finalize_model_grads import _update_router_expert_bias
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe.moe_utils import get_updated_expert_bias
from megatron_core.transformer.moe.router import TopKRouter


def _router(enable_expert_bias: bool = True) -> TopKRouter:
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4,
                               moe_router_topk=2, moe_router_score_function="sigmoid",
                               moe_router_enable_expert_bias=enable_expert_bias, moe_router_bias_update_rate=0.1)
    return TopKRouter(config)


def test_finalize_updates_expert_bias_by_the_routers_rule():
    router = _router()
    counts = torch.tensor([5.0, 1.0, 0.0, 2.0])
    router.local_tokens_per_expert.copy_(counts)
    router.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.0, 0.3]))
    expected = get_updated_expert_bias(counts.clone(), router.expert_bias.clone(), 0.1, None)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), router)
    _update_router_expert_bias([model])
    torch.testing.assert_close(router.expert_bias, expected)
    assert torch.count_nonzero(router.local_tokens_per_expert) == 0
    assert not torch.equal(expected, torch.tensor([0.1, -0.2, 0.0, 0.3]))


def test_router_without_expert_bias_is_left_alone():
    router = _router(enable_expert_bias=False)
    assert router.expert_bias is None
    router.update_expert_bias()
