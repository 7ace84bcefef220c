"""The inference-optimized MoE parts: ``InferenceTopKRouter``, ``InferenceGroupedMLP`` and the MoE layer over them.

Under an inference engine (``InferenceMode``) the router's dense ``[tokens, topk]`` output equals ``TopKRouter``'s
sparse output gathered at the chosen experts; the experts' dense forward equals the parent's forward on the same
routing; an MoE layer built from ``get_inference_optimized_moe_spec`` equals the training spec's layer on the same
weights. Outside an engine both fall back to their parents. Configs they cannot serve raise ``ValueError``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core._ground.inference_mode import InferenceMode
from megatron_core.inference.utils import InferenceMode as EngineInferenceMode
from megatron_core.models.gpt.moe_module_specs import get_inference_optimized_moe_spec, get_moe_module_spec
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.moe.experts import GroupedMLPSubmodules, InferenceGroupedMLP, TEGroupedMLP
from megatron_core.transformer.moe.grouped_linear import ColumnParallelGroupedLinear, RowParallelGroupedLinear
from megatron_core.transformer.moe.router import InferenceTopKRouter, TopKRouter, sparse_routing_from_dense

ROUTERS = {
    "softmax": dict(moe_router_score_function="softmax"),
    "softmax_pre": dict(moe_router_score_function="softmax", moe_router_pre_softmax=True,
                        moe_router_topk_scaling_factor=2.0),
    "sigmoid_bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
}


@pytest.fixture(autouse=True)
def _engine_flag_off():
    """Each test starts and ends outside an engine (the engines set the process-wide flag and keep it)."""
    InferenceMode.unset_active()
    yield
    InferenceMode.unset_active()


def _config(**overrides) -> TransformerConfig:
    cfg = dict(num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, num_moe_experts=6,
               moe_router_topk=2, moe_ffn_hidden_size=12, normalization="RMSNorm", gated_linear_unit=True,
               activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
               use_cpu_initialization=True)
    cfg.update(overrides)
    return TransformerConfig(**cfg)


def test_engine_flag_is_one_object():
    assert EngineInferenceMode is InferenceMode


def _routers(config: TransformerConfig) -> tuple[TopKRouter, InferenceTopKRouter]:
    torch.manual_seed(0)
    ref = TopKRouter(config)
    router = InferenceTopKRouter(config)
    router.load_state_dict(ref.state_dict())
    if ref.expert_bias is not None:
        bias = torch.linspace(-0.3, 0.3, config.num_moe_experts)
        ref.expert_bias.copy_(bias)
        router.expert_bias.copy_(bias)
    return ref.eval(), router.eval()


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_inference_router_dense_output_is_the_sparse_output_gathered(name: str):
    ref, router = _routers(_config(**ROUTERS[name]))
    x = torch.randn(5, 3, 16)
    with torch.no_grad():
        sparse_probs, routing_map = ref(x)
        with InferenceMode.active():
            probs, indices = router(x)
    assert probs.shape == indices.shape == (15, 2) and indices.dtype == torch.long
    assert torch.equal(torch.zeros_like(routing_map).scatter(1, indices, True), routing_map)
    torch.testing.assert_close(probs, sparse_probs.gather(1, indices), rtol=1e-6, atol=1e-6)
    dense_as_sparse, dense_map = sparse_routing_from_dense(probs, indices, 6)
    assert torch.equal(dense_map, routing_map)
    torch.testing.assert_close(dense_as_sparse, sparse_probs, rtol=1e-6, atol=1e-6)


def test_inference_router_outside_an_engine_is_the_top_k_router():
    config = _config(moe_aux_loss_coeff=0.01, moe_router_enable_expert_bias=True,
                     moe_router_score_function="sigmoid")
    ref, router = _routers(config)
    ref.train()
    router.train()
    x = torch.randn(5, 3, 16)
    out_ref, out = ref(x), router(x)
    torch.testing.assert_close(out[0], out_ref[0], rtol=0, atol=0)
    assert torch.equal(out[1], out_ref[1]) and out[1].dtype == torch.bool
    torch.testing.assert_close(router.local_tokens_per_expert, ref.local_tokens_per_expert)


def test_inference_router_skips_training_only_steps():
    """Under an engine no expert load is counted (no bias update), even in training mode."""
    _, router = _routers(_config(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"))
    router.train()
    with InferenceMode.active():
        router(torch.randn(4, 2, 16))
    assert router.local_tokens_per_expert.sum() == 0


@pytest.mark.parametrize("overrides,field", [
    (dict(moe_router_num_groups=2, moe_router_group_topk=1), "moe_router_num_groups"),
    (dict(moe_router_score_function="sqrtsoftplus"), "moe_router_score_function"),
])
def test_inference_router_refuses_configs_by_name(overrides: dict, field: str):
    with pytest.raises(ValueError, match=field):
        InferenceTopKRouter(_config(**overrides))


def _experts(config: TransformerConfig, cls: type = InferenceGroupedMLP) -> TEGroupedMLP:
    submodules = GroupedMLPSubmodules(linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear)
    return cls(config.num_moe_experts, config, submodules)


@pytest.mark.parametrize("overrides", [dict(), dict(add_bias_linear=True), dict(moe_apply_probs_on_input=True,
                                                                                moe_router_topk=1)])
def test_inference_experts_dense_forward_equals_the_parent_on_the_same_routing(overrides: dict):
    config = _config(**overrides)
    torch.manual_seed(0)
    parent = _experts(config, TEGroupedMLP)
    experts = _experts(config)
    experts.load_state_dict(parent.state_dict())
    assert experts.state_dict().keys() == parent.state_dict().keys()
    assert experts.sharded_state_dict().keys() == parent.sharded_state_dict().keys()
    tokens, topk = 9, config.moe_router_topk
    x = torch.randn(tokens, 16)
    indices = torch.stack([torch.randperm(6)[:topk] for _ in range(tokens)])
    probs = torch.rand(tokens, topk)
    # The parent on the same routing: one row per (token, expert), grouped by expert, summed per token.
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of_row = torch.arange(tokens).repeat_interleave(topk)[order]
    rows, _ = parent(x[token_of_row], torch.bincount(flat, minlength=6).tolist(), probs.reshape(-1)[order])
    expected = torch.zeros(tokens, 16).index_add_(0, token_of_row, rows)
    with InferenceMode.active(), torch.no_grad():
        got, bias = experts(x, None, probs, indices)
    assert bias is None
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # Outside an engine: the parent's forward.
    counts = [3, 0, 5, 1, 4, 5]
    rows_in, row_probs = torch.randn(18, 16), torch.rand(18)
    torch.testing.assert_close(experts(rows_in, counts, row_probs)[0], parent(rows_in, counts, row_probs)[0],
                               rtol=0, atol=0)


@pytest.mark.parametrize("overrides,field", [
    (dict(inference_grouped_gemm_backend="flashinfer"), "inference_grouped_gemm_backend"),
    (dict(fp8="e4m3", fp8_recipe="mxfp8"), "mxfp8"),
])
def test_inference_experts_refuse_backends_by_name(overrides: dict, field: str):
    try:
        config = _config(**overrides)
    except ValueError as err:  # the config itself may refuse an FP8 recipe this machine cannot run
        pytest.skip(f"config refused: {err}")
    with pytest.raises(ValueError, match=field):
        _experts(config)


def _moe_layers(config: TransformerConfig):
    torch.manual_seed(0)
    ref = get_moe_module_spec(use_te=False, num_experts=6, moe_grouped_gemm=True)(config=config)
    layer = get_inference_optimized_moe_spec()(config=config)
    layer.load_state_dict(ref.state_dict())
    return ref.eval(), layer.eval()


@pytest.mark.parametrize("overrides", [
    dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
         moe_shared_expert_intermediate_size=16),
    dict(moe_router_pre_softmax=True),
])
def test_inference_moe_layer_equals_the_training_layer(overrides: dict):
    config = _config(**overrides)
    ref, layer = _moe_layers(config)
    assert type(layer.router) is InferenceTopKRouter and type(layer.experts) is InferenceGroupedMLP
    x = torch.randn(5, 3, 16)
    with torch.no_grad():
        expected, _ = ref(x)
        outside, _ = layer(x)
        with InferenceMode.active():
            dense, _ = layer(x)
    torch.testing.assert_close(outside, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dense, expected, rtol=1e-6, atol=1e-6)


def test_inference_moe_layer_without_dense_experts_uses_the_dispatcher():
    """Dense routing from the router meets experts that do not take it: it becomes a routing map."""
    config = _config()
    ref, layer = _moe_layers(config)
    layer.experts.takes_dense_routing = False
    x = torch.randn(5, 3, 16)
    with torch.no_grad(), InferenceMode.active():
        got, _ = layer(x)
    torch.testing.assert_close(got, ref(x)[0], rtol=1e-6, atol=1e-6)


def test_inference_moe_layer_trains_like_the_training_layer():
    config = _config(moe_aux_loss_coeff=0.01)
    ref, layer = _moe_layers(config)
    ref.train()
    layer.train()
    x = torch.randn(5, 3, 16)
    ref(x)[0].square().sum().backward()
    layer(x)[0].square().sum().backward()
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), layer.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inference_moe_on_cuda_equals_the_training_layer():
    """On CUDA the router is compiled and the experts use torch grouped_mm (bf16 weights, fp32 reference)."""
    config = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    ref, layer = _moe_layers(config)
    ref, layer = ref.cuda(), layer.cuda()
    x = torch.randn(64, 2, 16, device="cuda")
    with torch.no_grad():
        expected, _ = ref(x)
        with InferenceMode.active():
            dense, _ = layer(x)
        torch.testing.assert_close(dense, expected, rtol=1e-5, atol=1e-5)
        ref, layer = ref.to(torch.bfloat16), layer.to(torch.bfloat16)
        expected, _ = ref(x.bfloat16())
        with InferenceMode.active():
            dense, _ = layer(x.bfloat16())
        torch.testing.assert_close(dense.float(), expected.float(), rtol=2e-2, atol=2e-2)
