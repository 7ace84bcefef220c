"""MoE layers under ``torch.compile``: one graph serves every layer, and aux losses do not break the graph."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe import MoEAuxLossAutoScaler, get_moe_metrics_tracker
from megatron_core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
from megatron_core.transformer.moe.router import TopKRouter


def _cfg() -> TransformerConfig:
    return TransformerConfig(
        num_layers=4, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=4,
        moe_router_topk=2, add_bias_linear=False, use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=F.silu, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
        moe_router_load_balancing_type="seq_aux_loss",
    )


def _routers(cfg: TransformerConfig) -> list[TopKRouter]:
    torch.manual_seed(0)
    routers = []
    for layer in range(1, cfg.num_layers + 1):
        router = TopKRouter(cfg)
        router.set_layer_number(layer)
        routers.append(router)
    return routers


def _route_loss(router: TopKRouter, x: torch.Tensor) -> torch.Tensor:
    probs, _ = router(x)
    return (probs * torch.arange(probs.shape[-1], dtype=probs.dtype)).sum()


def test_routers_of_every_layer_share_one_compiled_graph_with_aux_losses():
    cfg = _cfg()
    routers = _routers(cfg)
    x = torch.randn(8, 2, cfg.hidden_size)
    destroy_moe_metrics_tracker()  # entries sized by other tests' models would change the guards
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    _route_loss(routers[0], x).backward()  # eagerly first: the tracker's entries exist before compiling
    get_moe_metrics_tracker().clear()
    torch._dynamo.reset()
    # fullgraph: the aux losses' backward (traced with the forward) must not break the graph;
    # error_on_recompile: the layer number must not specialise the graph.
    compiled = torch.compile(_route_loss, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for router in routers:
            compiled(router, x).backward()
    torch._dynamo.reset()
    tracker = get_moe_metrics_tracker()
    for name in ("seq_load_balancing_loss", "z_loss", "load_imbalance"):
        values = tracker.metrics[name].values
        assert torch.all(values > 0), (name, values)  # every layer recorded into its own slot


def test_compiled_aux_loss_gradients_follow_the_scale_of_each_step():
    cfg = _cfg()
    x = torch.randn(8, 2, cfg.hidden_size)
    grads = []
    for compile_it in (False, True):
        router = _routers(cfg)[0]
        fn = torch.compile(_route_loss, backend="aot_eager", fullgraph=True) if compile_it else _route_loss
        step_grads = []
        for scale in (1.0, 7.0):
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))  # before the forward, as the schedules do
            router.weight.grad = None
            fn(router, x).backward()
            step_grads.append(router.weight.grad.clone())
        grads.append(step_grads)
        torch._dynamo.reset()
    assert not torch.allclose(grads[0][0], grads[0][1])  # the scale matters to the gradient
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_tracker_grows_for_a_model_with_more_layers():
    destroy_moe_metrics_tracker()
    tracker = get_moe_metrics_tracker()
    tracker.record("z_loss", torch.tensor(1.0), 2, 2)
    tracker.record("z_loss", torch.tensor(3.0), 4, 4)  # a later, deeper model
    tracker.record("z_loss", torch.tensor(5.0), torch.tensor(1), 4)
    assert tracker.metrics["z_loss"].values.tolist() == [5.0, 1.0, 0.0, 3.0]
    destroy_moe_metrics_tracker()


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
def test_capacity_padded_moe_layer_compiles_as_one_graph(grouped, dispatcher):
    # Padded to capacity, every local expert holds the same number of rows: the experts take the counts from
    # the row count, and the all-gather dispatcher its row count from the shapes, instead of reading
    # tokens_per_expert (a graph break per layer before).
    from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec

    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=4,
        moe_router_topk=2, add_bias_linear=False, use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=F.silu, moe_token_dispatcher_type=dispatcher, moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    mlp = GPTModel(cfg, get_gpt_layer_local_spec(4, moe_grouped_gemm=grouped), 32, 16).decoder.layers[0].mlp
    x = torch.randn(8, 2, cfg.hidden_size, requires_grad=True)
    want = mlp(x)[0]
    want.square().sum().backward()
    want_grads = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad()
    torch._dynamo.reset()
    got = torch.compile(mlp, backend="aot_eager", fullgraph=True)(x)[0]
    got.square().sum().backward()
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip([x.grad] + [p.grad for p in mlp.parameters()], want_grads):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
