"""The routers' Sinkhorn and quantile-balancing types, and the accepted TE fusion flags.

- ``sinkhorn`` and the router's Sinkhorn routing equal megatron-core's (the installed package as an oracle), in
  training and evaluation, top-1 and top-k.
- ``qb_dual_update`` equals a direct sort-based formula (and megatron-core's where it has one); the router routes
  exactly as ``topk_routing_with_score_function`` with ``precomputed_indices`` from ``logits - qb_beta``;
  ``finalize_model_grads`` updates ``qb_beta`` as computed by hand over two micro-batches; under data parallelism
  and TP=2 with sequence parallelism the bias, losses and parameters match a single process.
- A tiny MoE GPT trains a step with each type; ``moe_router_fusion`` / ``moe_permute_fusion`` change nothing.
- Refused combinations raise ``ValueError`` naming the fields.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe import MoEAuxLossAutoScaler
from megatron_core.transformer.moe.moe_utils import qb_dual_update, sinkhorn, topk_routing_with_score_function
from megatron_core.transformer.moe.router import TopKRouter
from tests.dist_harness import run_on_ranks
from tests.transformer.moe.moe_parallel_utils import (
    batches,
    build,
    global_tensors,
    load_globals,
    local_vs_global,
)

H, E = 16, 8
QB = dict(moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0)


def _oracle_moe_utils():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.transformer.moe.moe_utils")


def _oracle_router():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.transformer.moe.router")


def _router(**overrides) -> TopKRouter:
    cfg = dict(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_router_topk=2,
               use_cpu_initialization=True, add_bias_linear=False)
    cfg.update(overrides)
    torch.manual_seed(7)
    return TopKRouter(TransformerConfig(**cfg))


# --- Sinkhorn -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(16, 4), (48, 8), (7, 3)])
def test_sinkhorn_matches_megatron_core(shape: tuple[int, int]):
    oracle = _oracle_moe_utils()
    torch.manual_seed(0)
    cost = torch.randn(*shape) * 2
    got, want = sinkhorn(cost.clone()), oracle.sinkhorn(cost.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # The last update rescales the columns: each sums to 1 / num_experts.
    torch.testing.assert_close(got.sum(dim=0), torch.full((shape[1],), 1.0 / shape[1]), rtol=1e-4, atol=1e-6)
    loose = sinkhorn(cost.clone(), tol=1e-2)
    torch.testing.assert_close(loose, oracle.sinkhorn(cost.clone(), tol=1e-2), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("training", [True, False])
def test_sinkhorn_routing_matches_megatron_core(topk: int, training: bool):
    oracle = _oracle_router()
    extra = dict(moe_router_pre_softmax=True) if topk == 1 else {}
    router = _router(moe_router_load_balancing_type="sinkhorn", moe_router_topk=topk, **extra)
    router.train(training)
    torch.manual_seed(1)
    logits = torch.randn(24, E) * 3
    fake = types.SimpleNamespace(topk=topk, training=training, config=types.SimpleNamespace(moe_aux_loss_coeff=0.0))
    want_probs, want_map = oracle.TopKRouter.sinkhorn_load_balancing(fake, logits.clone())
    got_probs, got_map = router.sinkhorn_load_balancing(logits.clone())
    assert torch.equal(got_map, want_map)
    torch.testing.assert_close(got_probs, want_probs, rtol=0, atol=0)
    # Through routing(): [s, b, E] logits give the same result (no z-loss, no dropping).
    probs, routing_map = router.routing(logits.clone().reshape(12, 2, E))
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs, want_probs, rtol=0, atol=0)


def test_sinkhorn_training_selection_balances_and_differs_from_plain_topk():
    router = _router(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1, moe_router_pre_softmax=True)
    logits = torch.randn(64, E)
    logits[:, 0] += 4.0  # plain top-1 would send almost every token to expert 0
    _, train_map = router.train().sinkhorn_load_balancing(logits)
    _, eval_map = router.eval().sinkhorn_load_balancing(logits)
    assert eval_map[:, 0].sum() > 48
    assert train_map.sum(dim=0).max() < eval_map.sum(dim=0).max()


# --- Quantile balancing ---------------------------------------------------------------------------------------------

def _qb_formula(scores: torch.Tensor, k: int, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts and quantile by sorting: alpha = each token's (k+1)-th best shifted score; the expert's
    (m*k/n + 1)-th largest of ``scores - alpha``."""
    m, n = scores.shape
    shifted = torch.sort(scores - beta, dim=1, descending=True)
    alpha = shifted.values[:, k].unsqueeze(1)
    quantile = torch.sort(scores - alpha, dim=0, descending=True).values[m * k // n]
    return shifted.indices[:, :k], quantile


@pytest.mark.parametrize("m,k,n", [(16, 2, 8), (12, 1, 4), (40, 3, 6)])
def test_qb_dual_update_matches_a_direct_formula(m: int, k: int, n: int):
    torch.manual_seed(m + k)
    scores, beta = torch.randn(m, n), torch.randn(n) * 0.3
    indices, quantile = qb_dual_update(scores, k, beta)
    want_indices, want_quantile = _qb_formula(scores, k, beta)
    assert torch.equal(indices.sort(dim=1).values, want_indices.sort(dim=1).values)
    torch.testing.assert_close(quantile, want_quantile, rtol=0, atol=0)
    eval_indices, same_beta = qb_dual_update(scores, k, beta, update_beta=False)
    assert torch.equal(eval_indices, indices) and same_beta is beta
    oracle = getattr(_oracle_moe_utils(), "qb_dual_update", None)
    if oracle is not None:  # megatron-core >= 0.19
        want = oracle(scores, k, beta)
        assert torch.equal(indices, want[0])
        torch.testing.assert_close(quantile, want[1], rtol=0, atol=0)


def _loads(scores: torch.Tensor, k: int, beta: torch.Tensor) -> torch.Tensor:
    indices, _ = qb_dual_update(scores, k, beta, update_beta=False)
    return torch.zeros(scores.shape[1]).scatter_add_(0, indices.flatten(), torch.ones(indices.numel()))


def test_repeated_qb_updates_balance_a_skewed_router():
    torch.manual_seed(3)
    scores = torch.randn(64, 8)
    scores[:, 0] += 1.5  # expert 0 is everyone's favourite; the fair share is 64 * 2 / 8 = 16
    beta = torch.zeros(8)
    assert _loads(scores, 2, beta).max() > 40
    for _ in range(4):
        _, quantile = qb_dual_update(scores, 2, beta)
        beta = quantile - quantile.mean()
    assert _loads(scores, 2, beta).max() <= 20


def test_qb_dual_update_refuses_indivisible_token_counts():
    with pytest.raises(ValueError, match="divisible by num_moe_experts"):
        qb_dual_update(torch.randn(3, 4), 2, torch.zeros(4))
    qb_dual_update(torch.randn(3, 4), 2, torch.zeros(4), update_beta=False)  # evaluation has no such rule


QB_ROUTINGS = [
    dict(),
    dict(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.0),
    dict(moe_router_score_function="sigmoid"),
    dict(moe_router_score_function="sqrtsoftplus", moe_router_topk=3),
]


@pytest.mark.parametrize("overrides", QB_ROUTINGS)
@pytest.mark.parametrize("training", [True, False])
def test_quantile_balancing_routes_like_precomputed_indices(overrides: dict, training: bool):
    router = _router(**QB, **overrides)
    cfg = router.config
    router.qb_beta.copy_(torch.linspace(-0.5, 0.5, E))
    router.train(training)
    logits = torch.randn(8, 2, E, requires_grad=True)
    probs, routing_map = router.routing(logits)
    flat = logits.reshape(-1, E)
    indices = (flat.detach() - router.qb_beta).topk(cfg.moe_router_topk, dim=1).indices
    want_probs, want_map = topk_routing_with_score_function(
        flat, cfg.moe_router_topk, use_pre_softmax=cfg.moe_router_pre_softmax,
        scaling_factor=cfg.moe_router_topk_scaling_factor, score_function=cfg.moe_router_score_function,
        precomputed_indices=indices)
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs, want_probs, rtol=0, atol=0)
    probs.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    assert int(router.qb_beta_count) == int(training)


def test_quantile_balancing_buffers_and_state_dict():
    router = _router(**QB)
    assert router.qb_beta.dtype == torch.float32 and router.qb_beta_count.dtype == torch.long
    keys = set(router.state_dict())
    assert "qb_beta" in keys and "qb_beta_accum" not in keys and "qb_beta_count" not in keys
    router.to(torch.bfloat16)
    router(torch.randn(4, 2, H, dtype=torch.bfloat16))
    assert router.qb_beta.dtype == torch.float32 and router.qb_beta_accum.dtype == torch.float32
    plain = _router()
    assert plain.qb_beta is None and "qb_beta" not in plain.state_dict()


def test_quantile_balancing_update_after_finalize_matches_hand_computation():
    ema = 0.25
    router = _router(**QB, moe_router_quantile_balancing_ema=ema)
    beta0 = torch.tensor([0.3, -0.1, 0.2, -0.4, 0.0, 0.1, -0.2, 0.1])
    router.qb_beta.copy_(beta0)
    router.train()
    quantiles = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        x = torch.randn(6, 2, H)
        _, routing_map = router(x)
        logits = (x.reshape(-1, H) @ router.weight.detach().T).float()
        want_indices, quantile = _qb_formula(logits, 2, beta0)
        want_map = torch.zeros_like(routing_map).scatter(1, want_indices, True)
        assert torch.equal(routing_map, want_map)
        quantiles.append(quantile)
    with torch.no_grad():  # no gradient (e.g. a recompute's first pass): not accumulated
        router(torch.randn(6, 2, H))
    router.eval()
    router(torch.randn(6, 2, H))  # evaluation: not accumulated either
    router.train()
    assert int(router.qb_beta_count) == 2
    finalize_model_grads([router])
    blended = ema * beta0 + (1 - ema) * (quantiles[0] + quantiles[1]) / 2
    torch.testing.assert_close(router.qb_beta, blended - blended.mean(), rtol=1e-6, atol=1e-7)
    assert int(router.qb_beta_count) == 0 and not router.qb_beta_accum.any()
    # A router in evaluation mode keeps its bias; its accumulators are still reset.
    router.qb_beta_accum.fill_(1.0)
    router.qb_beta_count.fill_(1)
    before = router.qb_beta.clone()
    router.eval()
    finalize_model_grads([router])
    assert torch.equal(router.qb_beta, before) and not router.qb_beta_accum.any()


def test_quantile_balancing_refuses_a_padding_mask():
    router = _router(**QB)
    with pytest.raises(ValueError, match="padding_mask"):
        router(torch.randn(4, 2, H), padding_mask=torch.zeros(4, 2, dtype=torch.bool))


# --- Data / tensor parallelism ----------------------------------------------------------------------------------------

QB_GPT = dict(moe_router_topk=2, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="quantile_balancing",
              moe_router_quantile_balancing_ema=0.25)
WORLD = 2


def _qb_betas(model: torch.nn.Module) -> list[torch.Tensor]:
    return [m.qb_beta.clone() for m in model.modules() if getattr(m, "qb_beta", None) is not None]


def _qb_reference(dp: int) -> tuple[dict, list[torch.Tensor], dict, list[torch.Tensor], torch.Tensor]:
    """Initial globals, per-micro-batch losses, globals after an SGD step (lr 1), biases, next-step loss."""
    torch.manual_seed(1234)
    model = build("mixtral", **QB_GPT)
    before = global_tensors(model)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / dp))
    losses = []
    for ids, pos, labels in batches(dp):
        loss = model(ids, pos, None, labels=labels).mean()
        (loss / dp).backward()
        losses.append(loss.detach())
    finalize_model_grads([model])
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(p.grad)
        ids, pos, labels = batches(1, seed=11)[0]
        next_loss = model(ids, pos, None, labels=labels).mean()
    return before, losses, global_tensors(model), _qb_betas(model), next_loss


def _qb_check(layouts: list[int]) -> list[str]:
    done = []
    for tp in layouts:
        dp = WORLD // tp
        before, ref_losses, after, ref_betas, ref_next = _qb_reference(dp)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            model = build("mixtral", tensor_model_parallel_size=tp, sequence_parallel=tp > 1, **QB_GPT)
            load_globals(model, before)
            ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
            opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0,
                                                         clip_grad=0.0), [ddp])
            ddp.zero_grad_buffer()
            opt.zero_grad()
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
            dp_rank = parallel_state.get_data_parallel_rank()
            ids, pos, labels = batches(dp)[dp_rank]
            loss = ddp(ids, pos, None, labels=labels).mean()
            loss.backward()
            finalize_model_grads([ddp])
            opt.step()
            tag = f"tp={tp} dp={dp}"
            torch.testing.assert_close(loss.detach(), ref_losses[dp_rank], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, t=tag: f"{t} loss: {m}")
            for got, want in zip(_qb_betas(model), ref_betas, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, t=tag: f"{t} qb_beta: {m}")
            for key, local, ref in local_vs_global(model, after):
                if key.endswith("qb_beta"):
                    continue
                torch.testing.assert_close(local, ref, rtol=1e-5, atol=1e-5, msg=lambda m, k=key, t=tag: f"{t} {k}: {m}")
            with torch.no_grad():
                ids, pos, labels = batches(1, seed=11)[0]
                next_loss = ddp(ids, pos, None, labels=labels).mean()
            torch.testing.assert_close(next_loss, ref_next, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, t=tag: f"{t} next-step loss: {m}")
            done.append(tag)
        finally:
            parallel_state.destroy_model_parallel()
    return done


def test_quantile_balancing_under_dp_and_tp_sp_matches_single_process():
    results = run_on_ranks(WORLD, _qb_check, [1, 2])
    assert results == [["tp=1 dp=2", "tp=2 dp=1"]] * WORLD


# --- A tiny MoE GPT -----------------------------------------------------------------------------------------------------

GPT_TYPES = {
    "sinkhorn-top1": dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1, moe_aux_loss_coeff=0.0,
                          moe_router_pre_softmax=True),
    "sinkhorn-top2": dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk=2, moe_aux_loss_coeff=0.0),
    "quantile_balancing": QB_GPT,
}


@pytest.mark.parametrize("name", list(GPT_TYPES))
def test_tiny_moe_gpt_trains_a_step(name: str):
    torch.manual_seed(0)
    model = build("mixtral", **GPT_TYPES[name])
    ids, pos, labels = batches(1)[0]
    loss = model(ids, pos, None, labels=labels).mean()
    loss.backward()
    assert torch.isfinite(loss)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == 2
    for router in routers:
        assert router.weight.grad is not None and torch.isfinite(router.weight.grad).all()
        assert router.weight.grad.abs().sum() > 0
    finalize_model_grads([model])
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.1 * p.grad)
        after = model(ids, pos, None, labels=labels).mean()
    assert torch.isfinite(after) and after < loss


def test_quantile_balancing_with_moe_recompute_accumulates_once_per_micro_batch():
    results = []
    for extra in ({}, dict(recompute_granularity="selective", recompute_modules=["moe"])):
        torch.manual_seed(0)
        model = build("mixtral", **QB_GPT, **extra)
        for ids, pos, labels in batches(2):
            model(ids, pos, None, labels=labels).mean().backward()
        router = model.decoder.layers[0].mlp.router
        assert int(router.qb_beta_count) == 2
        finalize_model_grads([model])
        results.append((router.qb_beta.clone(), router.weight.grad.clone()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-6, atol=1e-7)


# --- Fusion flags ---------------------------------------------------------------------------------------------------------

def _loss_and_grads(flavour: str, **overrides) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build(flavour, **overrides)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    ids, pos, labels = batches(1)[0]
    loss = model(ids, pos, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("flavour", ["mixtral", "deepseek"])
def test_fusion_flags_change_nothing(flavour: str):
    loss, grads = _loss_and_grads(flavour)
    fused_loss, fused_grads = _loss_and_grads(flavour, moe_router_fusion=True, moe_permute_fusion=True)
    assert torch.equal(loss, fused_loss)
    assert grads.keys() == fused_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], fused_grads[name]), name


@pytest.mark.parametrize("kwargs", [dict(score_function="softmax"), dict(score_function="softmax", use_pre_softmax=True),
                                    dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.0),
                                    dict(score_function="sqrtsoftplus", dense_output=True)])
def test_fused_topk_routing_computes_the_unfused_result(kwargs: dict):
    torch.manual_seed(0)
    logits = torch.randn(10, 8)
    if kwargs["score_function"] != "softmax":
        kwargs = dict(kwargs, expert_bias=torch.randn(8) * 0.1)
    for a, b in zip(topk_routing_with_score_function(logits, 2, fused=True, **kwargs),
                    topk_routing_with_score_function(logits, 2, **kwargs)):
        assert torch.equal(a, b)


def test_fused_topk_routing_refuses_precomputed_indices():
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match="precomputed_indices"):
        topk_routing_with_score_function(logits, 2, fused=True, precomputed_indices=logits.topk(2, dim=1).indices)


# --- Refusals ---------------------------------------------------------------------------------------------------------------

REFUSED = [
    (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01), "moe_aux_loss_coeff"),
    (dict(QB, moe_aux_loss_coeff=0.01), "moe_aux_loss_coeff"),
    (dict(QB, moe_router_fusion=True), "moe_router_fusion"),
    (dict(QB, moe_router_num_groups=4, moe_router_group_topk=2), "moe_router_num_groups"),
    (dict(QB, moe_router_topk=E), "moe_router_topk"),
    (dict(QB, moe_router_quantile_balancing_ema=1.5), "moe_router_quantile_balancing_ema"),
    (dict(QB, moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor"),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor"),
    (dict(moe_router_load_balancing_type=["aux_loss", "sinkhorn"], moe_aux_loss_coeff=[0.01, 0.0]),
     "moe_router_load_balancing_type"),
    (dict(moe_router_load_balancing_type=["quantile_balancing"], moe_aux_loss_coeff=[0.0]),
     "moe_router_load_balancing_type"),
    (dict(moe_router_load_balancing_type="quantile-balancing"), "moe_router_load_balancing_type"),
]


@pytest.mark.parametrize("overrides,field", REFUSED, ids=[f for _, f in REFUSED])
def test_refused_combinations_name_the_fields(overrides: dict, field: str):
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_router_topk=2)
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**{**base, **overrides})


def test_accepted_combinations():
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_router_topk=2)
    for overrides in (dict(moe_router_fusion=True, moe_permute_fusion=True),
                      dict(QB, moe_permute_fusion=True, moe_router_quantile_balancing_ema=0.9),
                      dict(moe_router_load_balancing_type="sinkhorn", moe_router_fusion=True)):
        TransformerConfig(**{**base, **overrides})
