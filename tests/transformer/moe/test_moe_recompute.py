"""Selective recompute inside MoE layers: ``"moe_act"`` (the experts' activation), ``"shared_experts"``, ``"moe"``.

Each must leave the loss and every gradient unchanged (fp32, CPU) and actually recompute: the activation runs
again in the backward (counted through a wrapped activation function).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.transformer.moe.moe_parallel_utils import batches, build

CALLS = {"n": 0}


def counting_silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu`` that counts its calls."""
    CALLS["n"] += 1
    return F.silu(x)


def _run(flavour: str, **overrides) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    torch.manual_seed(3)
    model = build(flavour, activation_func=counting_silu, **overrides)
    ids, pos, labels = batches(1)[0]
    CALLS["n"] = 0
    loss = model(ids, pos, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, CALLS["n"]


CASES = [
    ("mixtral", dict(moe_grouped_gemm=False), ["moe_act"]),
    ("mixtral", dict(moe_grouped_gemm=True), ["moe_act"]),
    ("deepseek", dict(moe_grouped_gemm=True), ["shared_experts"]),
    ("deepseek", dict(moe_grouped_gemm=False), ["moe_act", "shared_experts"]),
    ("deepseek", dict(moe_grouped_gemm=True), ["moe_act", "shared_experts", "moe"]),
]


@pytest.mark.parametrize("flavour,layout,modules", CASES)
def test_moe_recompute_keeps_loss_and_gradients_and_runs_the_activation_again(flavour: str, layout: dict,
                                                                              modules: list[str]):
    want_loss, want, plain_calls = _run(flavour, **layout)
    loss, grads, calls = _run(flavour, recompute_granularity="selective", recompute_modules=modules, **layout)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert calls > plain_calls  # the recomputed activations ran again in the backward


@pytest.mark.parametrize("layout", [dict(moe_grouped_gemm=False), dict(moe_grouped_gemm=True)])
def test_mlp_recompute_leaves_moe_layers_alone(layout: dict):
    """``"mlp"`` recomputes dense MLPs only (as Megatron-Core): routed and shared experts keep their activations."""
    _, _, plain_calls = _run("deepseek", **layout)
    _, _, calls = _run("deepseek", recompute_granularity="selective", recompute_modules=["mlp"], **layout)
    assert calls == plain_calls


def test_mlp_recompute_runs_dense_layers_again_beside_moe_layers():
    """With ``moe_layer_freq`` mixing dense and MoE layers, ``"mlp"`` recomputes the dense layers' MLPs."""
    _, _, plain_calls = _run("mixtral", moe_layer_freq=[0, 1])
    _, _, calls = _run("mixtral", moe_layer_freq=[0, 1], recompute_granularity="selective",
                       recompute_modules=["mlp"])
    assert calls > plain_calls
