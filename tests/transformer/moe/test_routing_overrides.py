"""Megatron-Core's remaining MoE config fields: deprecated aliases, routing overrides, refused features, MoE recompute.

Single process, CPU, fp32. The padded routing map and the MoE-layer recompute must leave the loss and every
gradient unchanged; the random-logit overrides must route independently of the input and still train the router.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron_core import tensor_parallel
from megatron_core.megatron_only_fields import MegatronOnlyTransformerFields
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe import get_moe_metrics_tracker
from megatron_core.transformer.moe.moe_utils import (
    RandomSTEShared,
    apply_biased_logits,
    apply_random_logits,
    get_align_size_for_quantization,
    pad_routing_map,
)
from tests.transformer.moe.moe_parallel_utils import MAX_SEQ, VOCAB, batches

BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
            num_moe_experts=4, moe_router_topk=2, normalization="RMSNorm", gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01)


def _cfg(**overrides) -> TransformerConfig:
    return TransformerConfig(**{**BASE, **overrides})


def _model(**overrides) -> GPTModel:
    config = _cfg(**overrides)
    return GPTModel(config, get_gpt_decoder_block_spec(config, False), VOCAB, MAX_SEQ, position_embedding_type="rope")


def _loss_and_grads(model: GPTModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids, pos, labels = batches(1)[0]
    loss = model(ids, pos, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_pad_routing_map_fills_each_expert_with_its_earliest_free_tokens():
    gen = torch.Generator().manual_seed(0)
    routing_map = torch.rand(40, 5, generator=gen) < 0.3
    original = routing_map.clone()
    padded = pad_routing_map(routing_map, 8)
    assert padded.dtype == torch.bool and torch.equal(padded & routing_map, routing_map)  # every route kept
    assert (padded.sum(dim=0) % 8 == 0).all()
    for e in range(5):
        added = (padded[:, e] & ~routing_map[:, e]).nonzero().flatten()
        free = (~routing_map[:, e]).nonzero().flatten()
        assert torch.equal(added, free[: added.numel()])  # the earliest tokens not yet routed there
    assert torch.equal(pad_routing_map(routing_map, 1), routing_map)
    assert torch.equal(routing_map, original)  # the input is not modified


def test_align_size_for_quantization_follows_the_fp8_recipe():
    assert get_align_size_for_quantization(_cfg()) == 0
    assert get_align_size_for_quantization(_cfg(fp8="e4m3", fp8_recipe="tensorwise")) == 16
    assert get_align_size_for_quantization(_cfg(fp8="e4m3", fp8_recipe="mxfp8")) == 32


def test_padding_for_quantization_leaves_loss_and_gradients_unchanged():
    torch.manual_seed(7)
    plain = _model()
    state = plain.state_dict()
    torch.manual_seed(7)
    padded = _model(fp8="e4m3", moe_router_padding_for_quantization=True)
    padded.load_state_dict(state)
    want_loss, want = _loss_and_grads(plain)
    got_loss, got = _loss_and_grads(padded)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    tokens = batches(1)[0][0].numel()
    for layer in padded.decoder.layers:  # each expert padded to 16 rows, or to every token when there are fewer
        counts = torch.as_tensor(layer.mlp.token_dispatcher.tokens_per_expert)
        assert ((counts % 16 == 0) | (counts == tokens)).all() and counts.sum() > tokens * 2


def test_force_load_balancing_routes_independently_of_the_input_and_still_trains_the_router():
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    logits = torch.randn(64, 4, requires_grad=True)
    first = apply_random_logits(logits)
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    second = apply_random_logits(logits * 5 + 1)
    assert torch.equal(first, second)  # drawn from the expert-parallel RNG stream, not from the logits
    first.sum().backward()
    assert torch.equal(logits.grad, torch.ones_like(logits))  # straight-through gradient

    tensor_parallel.model_parallel_cuda_manual_seed(3)
    model = _model(moe_router_force_load_balancing=True)
    _, grads = _loss_and_grads(model)
    router = [g for name, g in grads.items() if name.endswith("router.weight")]
    assert router and all(g.abs().sum() > 0 for g in router)


def test_force_biased_draws_a_shared_bias_per_call_or_once_per_layer():
    RandomSTEShared.cache.clear()
    logits = torch.zeros(8, 4)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    a, b = apply_biased_logits(logits, -0.5, 1), apply_biased_logits(logits, -0.5, 1)
    bias_a, bias_b = RandomSTEShared.cache[1], RandomSTEShared.cache[1]
    assert torch.equal(bias_a, bias_b) and bias_a.abs().sum() > 0  # negative std: drawn once for layer 1
    assert not torch.equal(a, b)  # the random logits underneath are new on every call
    RandomSTEShared.cache.clear()
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    apply_biased_logits(logits, 0.5, 1)
    assert 1 not in RandomSTEShared.cache  # positive std: a new bias on every call


def test_moe_layer_recompute_gives_the_same_loss_gradients_and_metrics():
    tracker = get_moe_metrics_tracker()
    results = []
    for overrides in ({}, dict(recompute_granularity="selective", recompute_modules=["moe"]),
                      dict(moe_layer_recompute=True)):
        tracker.clear()
        torch.manual_seed(5)
        model = _model(moe_router_load_balancing_type="aux_loss", **overrides)
        assert model.decoder.layers[0].mlp.moe_layer_recompute == bool(overrides)
        loss, grads = _loss_and_grads(model)
        metrics = {name: entry.values.clone() for name, entry in tracker.metrics.items()}
        results.append((loss, grads, metrics))
    (want_loss, want, want_metrics), *others = results
    for loss, grads, metrics in others:
        torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
        for name, grad in want.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        assert metrics.keys() == want_metrics.keys()
        for name, values in want_metrics.items():  # recorded once, in the recompute (the forward runs without grad)
            torch.testing.assert_close(metrics[name], values, msg=lambda m, n=name: f"metric {n}: {m}")


def test_deprecated_aliases_map_onto_their_replacements():
    with pytest.warns(DeprecationWarning):
        cfg = _cfg(moe_layer_recompute=True)
    assert cfg.recompute_granularity == "selective" and "moe" in cfg.recompute_modules
    with pytest.warns(DeprecationWarning):
        cfg = _cfg(expert_model_parallel_size=2, moe_router_topk_limited_devices=1)
    assert (cfg.moe_router_group_topk, cfg.moe_router_num_groups) == (1, 2)
    with pytest.warns(DeprecationWarning):
        cfg = _cfg(fp8="e4m3", moe_router_padding_for_fp8=True)
    assert cfg.moe_router_padding_for_quantization


@pytest.mark.parametrize("overrides,words", [
    (dict(moe_layer_recompute=True, recompute_granularity="full", recompute_method="uniform",
          recompute_num_layers=1), ["moe_layer_recompute", "full"]),
    (dict(moe_router_topk_limited_devices=1, moe_router_num_groups=2, moe_router_group_topk=1),
     ["moe_router_topk_limited_devices", "moe_router_group_topk"]),
    (dict(moe_router_padding_for_quantization=True), ["moe_router_padding_for_quantization", "fp8"]),
    (dict(fp8="e4m3", moe_router_padding_for_quantization=True, moe_token_dispatcher_type="allgather"),
     ["moe_router_padding_for_quantization", "'allgather'"]),
    (dict(moe_router_force_biased=0.0), ["moe_router_force_biased", "0.0"]),
    (dict(moe_flex_dispatcher_backend="mooncake"), ["moe_flex_dispatcher_backend", "'mooncake'"]),
])
def test_bad_moe_overrides_name_the_fields(overrides: dict, words: list[str]):
    with pytest.raises(ValueError) as err:
        _cfg(**overrides)
    for word in words:
        assert word in str(err.value)


UNSUPPORTED_MOE_FIELDS = {f.name: f.default for f in dataclasses.fields(MegatronOnlyTransformerFields)
                          if f.name.startswith("moe_") and "refused" in f.metadata}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_MOE_FIELDS))
def test_unsupported_megatron_moe_fields_are_accepted_at_their_defaults_and_refused_otherwise(name: str):
    default = UNSUPPORTED_MOE_FIELDS[name]
    assert getattr(_cfg(**{name: default}), name) == default
    other = {False: True, None: 4}.get(default, 7 if isinstance(default, int) else 2.0)
    with pytest.raises(ValueError, match=name):
        _cfg(**{name: other})
