"""Single-process MoE checks: token dropping with known routing, expert layouts, routing options, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe import MoEAuxLossAutoScaler, get_moe_metrics_tracker
from megatron_core.transformer.moe.moe_utils import (
    apply_router_token_dropping,
    topk_routing_with_score_function,
)
from tests.transformer.moe.moe_parallel_utils import sequential_to_grouped_state

H = 16


def _cfg(**overrides) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=2,
                moe_router_topk=1, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                use_cpu_initialization=True, gated_linear_unit=True, activation_func=F.silu)
    return TransformerConfig(**{**base, **overrides})


def _known_routing() -> tuple[torch.Tensor, torch.Tensor]:
    """6 tokens, top-1 of 2 experts: tokens 0-4 go to expert 0 with probs .5 .9 .6 .8 .7, token 5 to expert 1."""
    p0 = torch.tensor([0.5, 0.9, 0.6, 0.8, 0.7, 0.0])
    probs = torch.stack([p0, torch.tensor([0, 0, 0, 0, 0, 0.95])], dim=1)
    return probs, probs > 0


def test_token_dropping_policies_with_known_routing():
    probs, routing_map = _known_routing()
    # capacity = ceil(6 tokens * top-1 / 2 experts * 1.0) = 3 per expert.
    kept_probs, kept = apply_router_token_dropping(probs, routing_map, 1, 1.0, "probs")
    assert kept[:, 0].nonzero().flatten().tolist() == [1, 3, 4]  # the 3 highest probabilities
    assert kept[:, 1].nonzero().flatten().tolist() == [5]
    assert torch.equal(kept_probs, probs * kept)
    _, kept = apply_router_token_dropping(probs, routing_map, 1, 1.0, "position")
    assert kept[:, 0].nonzero().flatten().tolist() == [0, 1, 2]  # the earliest tokens
    padded_probs, padded = apply_router_token_dropping(probs, routing_map, 1, 1.0, "position", pad_to_capacity=True)
    assert padded.sum(dim=0).tolist() == [3, 3]  # every expert padded to capacity
    assert padded[5, 1] and padded_probs[:, 1].count_nonzero() == 1  # padding slots carry probability 0
    _, kept = apply_router_token_dropping(probs, routing_map, 1, 4.0, "probs")
    assert torch.equal(kept, routing_map)  # capacity above the token count drops nothing


def _moe_layer(model: GPTModel):
    return model.decoder.layers[0].mlp


@pytest.mark.parametrize("dispatcher,pad", [("allgather", False), ("allgather", True), ("alltoall", False),
                                            ("alltoall", True)])
def test_dropped_tokens_get_no_expert_output(dispatcher: str, pad: bool):
    torch.manual_seed(0)
    cfg = _cfg(moe_expert_capacity_factor=1.0, moe_token_drop_policy="position", moe_token_dispatcher_type=dispatcher,
               moe_pad_expert_input_to_capacity=pad)
    model = GPTModel(cfg, get_gpt_layer_local_spec(2), 32, 16)
    layer = _moe_layer(model).eval()
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[1.0] + [0.0] * (H - 1), [-1.0] + [0.0] * (H - 1)]))
    x = torch.randn(6, 1, H)
    x[:5, 0, 0], x[5, 0, 0] = 1.0, -1.0  # tokens 0-4 prefer expert 0, token 5 expert 1
    with torch.no_grad():
        out, _ = layer(x)
        expert0 = layer.experts.local_experts[0](x[:3, 0], torch.ones(3))[0]
        expert1 = layer.experts.local_experts[1](x[5:, 0], torch.ones(1))[0]
    assert torch.count_nonzero(out[3:5]) == 0  # tokens 3 and 4 exceed expert 0's capacity of 3
    torch.testing.assert_close(out[:3, 0], expert0, rtol=1e-6, atol=1e-6)  # top-1 prob is 1
    torch.testing.assert_close(out[5:, 0], expert1, rtol=1e-6, atol=1e-6)


def test_sequential_and_grouped_layouts_convert_exactly():
    torch.manual_seed(0)
    cfg = _cfg(num_moe_experts=4, moe_router_topk=2)
    seq = GPTModel(cfg, get_gpt_layer_local_spec(4), 32, 16).eval()
    grouped = GPTModel(cfg, get_gpt_layer_local_spec(4, moe_grouped_gemm=True), 32, 16).eval()
    converted = sequential_to_grouped_state(seq.state_dict())
    grouped.load_state_dict(converted, strict=False)
    back = {k: v for k, v in grouped.state_dict().items()}
    for key, value in converted.items():
        assert torch.equal(back[key], value), key
    ids = torch.randint(0, 32, (2, 8))
    pos = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        assert torch.equal(seq(ids, pos, None), grouped(ids, pos, None))
    # The two layouts describe the same global checkpoint tensors.
    def describe(model):
        out = {}
        for item in model.sharded_state_dict().values():
            shards = item.build() if hasattr(item, "build") else {0: item}
            for shard in (shards.values() if isinstance(shards, dict) else shards):
                if isinstance(getattr(shard, "data", None), torch.Tensor) and "mlp" in shard.key:
                    out[(shard.key, shard.global_offset)] = (shard.global_shape, shard.data.clone())
        return out
    left, right = describe(seq), describe(grouped)
    assert left.keys() == right.keys() and any("mlp.experts.experts.linear_fc1.weight" in k[0] for k in left)
    for key in left:
        assert left[key][0] == right[key][0] and torch.equal(left[key][1], right[key][1]), key


def test_group_limited_sigmoid_routing_with_expert_bias():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0, 0.5, 0.2, 0.1]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0])
    probs, routing_map = topk_routing_with_score_function(logits, 2, num_groups=4, group_topk=2,
                                                          score_function="sigmoid", expert_bias=bias)
    # groups {0,1} {2,3} {4,5} {6,7}: the bias makes group 2 best, then group 0; expert 5 and expert 1 win.
    assert routing_map[0].nonzero().flatten().tolist() == [1, 5]
    scores = torch.sigmoid(logits[0, [1, 5]])
    torch.testing.assert_close(probs[0, [1, 5]], scores / scores.sum())  # the bias selects but does not weight


def test_aux_and_z_losses_reach_the_router_gradient_and_are_logged():
    torch.manual_seed(0)
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    cfg = _cfg(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    model = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, False), 32, 16)
    layer = _moe_layer(model)
    x = torch.randn(8, 2, H, requires_grad=True)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    probs, _ = layer.router(x)
    probs.sum().mul(0).backward()  # only the attached aux losses produce a gradient
    assert layer.router.weight.grad.abs().sum() > 0
    log = tracker.report(loss_scale=1.0, iteration=1, num_layers=2, moe_layer_freq=1)
    assert "load_balancing_loss" in log and "z_loss" in log and "load_imbalance" in log


def test_metrics_reduced_on_the_device_equal_the_reported_ones():
    from megatron_core.transformer.moe.moe_logging import MoEMetricsTracker

    def recorded() -> MoEMetricsTracker:
        tracker = MoEMetricsTracker()
        for layer, (aux, imbalance) in enumerate([(0.5, 1.25), (0.0, 0.0), (1.5, 2.0)], start=1):  # layer 2 dense
            tracker.record("load_balancing_loss", torch.tensor(aux), layer, 3)
            tracker.record("load_imbalance", torch.tensor(imbalance), layer, 3)
        return tracker

    losses: dict[str, float] = {}
    line = recorded().report(loss_scale=0.5, iteration=1, num_layers=3, moe_layer_freq=[1, 0, 1],
                             total_loss_dict=losses)
    tracker = recorded()
    on_device = tracker.reduce_on_device(loss_scale=0.5, num_layers=3, moe_layer_freq=[1, 0, 1])
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in on_device.values())
    assert float(on_device["load_balancing_loss"]) == losses["load_balancing_loss"] == 0.5 * (0.5 + 1.5) / 2
    assert line == f"load_imbalance: {float(on_device['load_imbalance']):.6E}"
    assert float(tracker.metrics["load_imbalance"].values.abs().sum()) == 0.0  # cleared


@pytest.mark.parametrize("overrides,message", [
    (dict(moe_router_topk=3), r"moe_router_topk \(3\) must be in \[1, num_moe_experts \(2\)\]"),
    (dict(expert_model_parallel_size=4, num_moe_experts=6), r"num_moe_experts \(6\) must be divisible by expert_model_parallel_size \(4\)"),
    (dict(moe_pad_expert_input_to_capacity=True), "needs moe_expert_capacity_factor"),
    (dict(moe_router_enable_expert_bias=True), "moe_router_score_function 'sigmoid'"),
    (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type"),
    (dict(moe_layer_freq=[1, 0, 1]), "moe_layer_freq has 3 entries but num_layers is 2"),
])
def test_bad_moe_config_is_rejected(overrides: dict, message: str):
    with pytest.raises(ValueError, match=message):
        _cfg(**overrides)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_grouped_kernel_path_pads_expert_rows_and_matches_sequential(monkeypatch, dispatcher):
    """The grouped-GEMM branch (emulated on CPU by a kernel that insists on aligned groups) equals SequentialMLP.

    The dispatcher permutes the tokens straight into the experts' aligned layout (zero padding rows).
    """
    from megatron_core.transformer.moe import grouped_linear
    from megatron_core.transformer.moe.experts import TEGroupedMLP
    from megatron_core.transformer.moe.token_permutation import AlignedRows

    calls, layouts = [], []
    forward = TEGroupedMLP.forward

    def spy(self, x, tokens_per_expert, probs):
        layouts.append(type(tokens_per_expert))
        if isinstance(tokens_per_expert, AlignedRows):  # the padding rows: zero inputs with zero probs
            ends = tokens_per_expert.ends.tolist()
            counts = torch.bincount(self_counts.pop(0), minlength=len(ends))
            for start, end, count in zip([0] + ends[:-1], ends, counts.tolist()):
                assert not x[start + count:end].any() and not probs[start + count:end].any()
        return forward(self, x, tokens_per_expert, probs)

    self_counts: list[torch.Tensor] = []
    monkeypatch.setattr(TEGroupedMLP, "forward", spy)

    def fake_grouped_mm(a, b, offs):
        ends = offs.tolist()
        starts = [0] + ends[:-1]
        assert all((e - s) % grouped_linear.GROUPED_MM_ROW_ALIGN == 0 for s, e in zip(starts, ends)), ends
        calls.append(ends)
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))])

    monkeypatch.setattr(grouped_linear, "_use_grouped_mm", lambda x, w: True)
    monkeypatch.setattr(grouped_linear, "_GROUPED_MM", fake_grouped_mm)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    torch.manual_seed(0)
    cfg = _cfg(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type=dispatcher)
    seq = GPTModel(cfg, get_gpt_layer_local_spec(4), 32, 16)
    grouped = GPTModel(cfg, get_gpt_layer_local_spec(4, moe_grouped_gemm=True), 32, 16)
    for layer in grouped.decoder.layers:  # each layer's routed expert of every (token, slot), for the spy
        layer.mlp.router.register_forward_hook(
            lambda module, args, out: self_counts.append(out[1].nonzero()[:, 1]))
    state = {}
    for key, value in seq.state_dict().items():
        if ".local_experts." in key and key.endswith(".weight"):
            head, rest = key.split(".local_experts.")
            idx, fc, _ = rest.split(".", 2)
            state[f"{head}.{fc}.weight{idx}"] = value
        elif ".local_experts." not in key:
            state[key] = value
    grouped.load_state_dict(state, strict=False)
    ids = torch.randint(0, 32, (2, 8))
    pos = torch.arange(8).expand(2, 8)
    want, got = seq(ids, pos, None, labels=ids), grouped(ids, pos, None, labels=ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    want.sum().backward()
    got.sum().backward()
    assert calls  # the kernel branch ran
    assert layouts == [AlignedRows, AlignedRows]  # both layers got rows the dispatcher laid out
    for index in range(2):
        for e in range(4):
            for fc in ("linear_fc1", "linear_fc2"):
                torch.testing.assert_close(
                    getattr(grouped.decoder.layers[index].mlp.experts, fc).weight.grad[e],
                    getattr(seq.decoder.layers[index].mlp.experts.local_experts[e], fc).weight.grad,
                    rtol=1e-5, atol=1e-6)
    grouped_grads = {k: v.grad for k, v in grouped.named_parameters() if ".experts." not in k}
    for name, param in seq.named_parameters():
        if ".experts." not in name:
            torch.testing.assert_close(grouped_grads[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)
