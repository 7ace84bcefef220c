"""``reset_model_temporary_tensors``: what Megatron-Core 0.19 restarts after each step's router updates (token
counts behind the expert bias, global-aux-loss counts, quantile accumulators), gated by the config."""

from __future__ import annotations

import torch

from megatron_core.distributed.finalize_model_grads import finalize_model_grads, reset_model_temporary_tensors
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe.router import TopKRouter


def _config(**overrides) -> TransformerConfig:
    cfg = dict(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4, moe_router_topk=2,
               use_cpu_initialization=True, add_bias_linear=False)
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def _filled(router: TopKRouter) -> TopKRouter:
    for name in ("local_tokens_per_expert", "global_tokens_per_expert", "qb_beta_accum"):
        buffer = getattr(router, name, None)
        if buffer is not None:
            buffer.fill_(3.0)
    for name in ("ga_steps", "qb_beta_count"):
        if getattr(router, name, None) is not None:
            getattr(router, name).fill_(2)
    return router


def test_resets_expert_bias_counts_and_global_aux_loss_tracker():
    config = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.01)
    train, teacher = _filled(TopKRouter(config)), _filled(TopKRouter(config))
    teacher.eval()  # an evaluation-mode module is reset too (its counts must not carry over)
    bias = train.expert_bias.clone()
    reset_model_temporary_tensors(config, [torch.nn.Sequential(train), torch.nn.Sequential(teacher)])
    for router in (train, teacher):
        assert not router.local_tokens_per_expert.any()
        assert not router.global_tokens_per_expert.any() and int(router.ga_steps) == 0
    assert torch.equal(train.expert_bias, bias)  # only accumulators are reset, never the bias itself


def test_config_gates_the_expert_bias_and_global_aux_loss_resets():
    built = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.01)
    router = _filled(TopKRouter(built))
    reset_model_temporary_tensors(_config(), [router])  # a config without either feature: nothing to reset
    assert router.local_tokens_per_expert.eq(3.0).all() and router.global_tokens_per_expert.eq(3.0).all()
    reset_model_temporary_tensors(None, [router])  # no model config: each module's own config decides
    assert not router.local_tokens_per_expert.any() and not router.global_tokens_per_expert.any()


def test_resets_quantile_accumulators_of_nested_routers():
    config = _config(moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0)
    router = _filled(TopKRouter(config))
    beta = torch.tensor([0.2, -0.1, 0.0, -0.1])
    router.qb_beta.copy_(beta)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(router))
    reset_model_temporary_tensors(config, [model])
    assert not router.qb_beta_accum.any() and int(router.qb_beta_count) == 0
    assert torch.equal(router.qb_beta, beta)


def test_finalize_model_grads_resets_after_updating():
    config = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.1, moe_router_load_balancing_type="global_aux_loss",
                     moe_aux_loss_coeff=0.01)
    router = TopKRouter(config)
    router.local_tokens_per_expert.copy_(torch.tensor([5.0, 1.0, 0.0, 2.0]))
    router.global_tokens_per_expert.fill_(4.0)
    finalize_model_grads([torch.nn.Sequential(router)])
    # The bias moved toward the under-used experts before the counts were cleared.
    assert router.expert_bias[2] > router.expert_bias[0]
    assert not router.local_tokens_per_expert.any() and not router.global_tokens_per_expert.any()
