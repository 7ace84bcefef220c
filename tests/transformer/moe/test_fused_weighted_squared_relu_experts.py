"""``use_fused_weighted_squared_relu`` (Megatron-Core 0.19): MoE experts with an ungated squared ReLU weight it by
the routing probabilities through ``weighted_squared_relu_impl``; loss and every gradient equal the plain
expression (grouped and sequential experts, probabilities applied in the experts or on their input)."""

from __future__ import annotations

import pytest
import torch

from megatron_core.activations import squared_relu
from megatron_core.fusions import fused_weighted_squared_relu as fused
from tests.transformer.moe.moe_parallel_utils import batches, build

CALLS = {"n": 0}


def _run(monkeypatch: pytest.MonkeyPatch, **overrides) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    original = fused.WeightedSquaredReLUFunction.apply

    def counting(*args):
        CALLS["n"] += 1
        return original(*args)

    monkeypatch.setattr(fused.WeightedSquaredReLUFunction, "apply", counting)
    torch.manual_seed(3)
    model = build("mixtral", gated_linear_unit=False, activation_func=squared_relu, **overrides)
    ids, pos, labels = batches(1)[0]
    CALLS["n"] = 0
    loss = model(ids, pos, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, CALLS["n"]


@pytest.mark.parametrize("layout", [dict(moe_grouped_gemm=True), dict(moe_grouped_gemm=False),
                                    dict(moe_grouped_gemm=True, add_bias_linear=True),
                                    dict(moe_grouped_gemm=False, add_bias_linear=True)],
                         ids=["grouped", "sequential", "grouped-bias", "sequential-bias"])
def test_fused_path_equals_the_plain_expression(monkeypatch, layout):
    want_loss, want, plain_calls = _run(monkeypatch, **layout)
    loss, grads, calls = _run(monkeypatch, use_fused_weighted_squared_relu=True, **layout)
    assert plain_calls == 0 and calls > 0  # the flag routes the experts' activation through the fused function
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7)
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_rule_needs_an_ungated_squared_relu():
    class Cfg:
        use_fused_weighted_squared_relu = True
        gated_linear_unit = False

    assert fused.uses_fused_weighted_squared_relu(Cfg, squared_relu)
    assert not fused.uses_fused_weighted_squared_relu(Cfg, torch.nn.functional.silu)
    Cfg.gated_linear_unit = True
    assert not fused.uses_fused_weighted_squared_relu(Cfg, squared_relu)
