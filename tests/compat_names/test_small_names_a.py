"""Small Megatron-Core 0.19 names: config_logger, VisionModule, torch norms, llava_spec, CudaGraphScope, the
weighted MoE activations, the fused cross-entropy steps, cat_with_oom_fallback and typing variables.

megatron-core 0.16.1 is the oracle where it has the name; otherwise a hand-written reference.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F

from megatron_core import config_logger, typed_torch
from megatron_core.fusions import fused_bias_geglu, fused_cross_entropy, fused_weighted_squared_relu
from megatron_core.models.common.vision_module import VisionModule
from megatron_core.models.multimodal import llava_spec
from megatron_core.models.vision.clip_vit_model import CLIPViTModel
from megatron_core.transformer import enums, identity_op, torch_layer_norm, torch_norm
from megatron_core.transformer import utils as transformer_utils
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_config import TransformerConfig


@pytest.fixture
def eager_megatron():
    """megatron-core 0.16.1 compiles its fused functions with torch.compile even on the CPU: run them eagerly."""
    with torch._dynamo.config.patch(disable=True):
        yield


def _tiny_config(**overrides) -> TransformerConfig:
    fields = dict(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, hidden_dropout=0.0,
                  attention_dropout=0.0, normalization="LayerNorm", use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **overrides})


# --- config_logger ---------------------------------------------------------------------------------------------
def test_config_logger_writes_numbered_json_and_pth(tmp_path):
    config = _tiny_config()
    assert not config_logger.has_config_logger_enabled(object())
    assert config_logger.get_config_logger_path(object()) == ""
    config.config_logger_dir = str(tmp_path / "logs")
    assert config_logger.has_config_logger_enabled(config)

    class Owner(torch.nn.Module):
        pass

    owner = Owner()
    owner.add_module("proj", torch.nn.Linear(2, 3))
    data = {"self": owner, "config": config, "dtype": torch.bfloat16, "act": F.gelu, "layers": [owner.proj],
            "mask": enums.AttnMaskType.causal, "n": 3}
    config_logger.log_config_to_disk(config, data, rank_str="0_0_0_0_0_0")
    config_logger.log_config_to_disk(config, {"self": owner}, rank_str="0_0_0_0_0_0")
    names = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert names == ["Owner.rank_0_0_0_0_0_0.iter0.json", "Owner.rank_0_0_0_0_0_0.iter1.json"]
    dumped = json.loads((tmp_path / "logs" / names[0]).read_text())
    assert "self" not in dumped and dumped["n"] == 3 and dumped["dtype"] == "torch.bfloat16"
    assert dumped["layers"] == [str(owner.proj)] and dumped["mask"] == "AttnMaskType.causal"
    assert dumped["config"]["hidden_size"] == 16 and dumped["config"]["config_logger_dir"] == str(tmp_path / "logs")
    state = OrderedDict(w=torch.ones(2))
    config_logger.log_config_to_disk(config, state, prefix="weights")  # ranks from parallel_state (0 when unset)
    torch.testing.assert_close(torch.load(tmp_path / "logs" / "weights.rank_0_0_0_0_0_0.iter0.pth")["w"],
                               torch.ones(2))
    assert config_logger.get_path_with_count(str(tmp_path / "x")).endswith("x.iter0")
    assert config_logger.get_path_count(str(tmp_path / "x")) == 1
    with pytest.raises(ValueError, match="config_logger_dir"):
        config_logger.log_config_to_disk(object(), {})


def test_json_encoder_matches_megatron_core_on_modules():
    theirs = pytest.importorskip("megatron.core.config_logger").JSONEncoderWithMcoreTypes
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.ReLU()]))
    for value in (model, torch.float16, F.silu, torch.nn.Linear):
        assert json.dumps(value, cls=config_logger.JSONEncoderWithMcoreTypes) == json.dumps(value, cls=theirs)


# --- modules and specs -----------------------------------------------------------------------------------------
def test_vision_module_and_norms():
    assert issubclass(CLIPViTModel, VisionModule)
    assert isinstance(VisionModule(_tiny_config()), torch.nn.Module)
    assert torch_layer_norm.WrappedTorchLayerNorm is torch_norm.WrappedTorchNorm
    x = torch.randn(3, 5, 8, dtype=torch.bfloat16)
    expected = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    norm = torch_norm.L2Norm(8, config=None)
    torch.testing.assert_close(norm(x), expected)
    assert list(norm.parameters()) == [] and norm.hidden_size == 8
    assert typing.get_type_hints(torch_norm.LayerNormBuilder.__call__)["return"] is torch_norm.LayerNormInterface


def _spec_tree(spec, path="") -> dict[str, str]:
    """``{path: class or function name}`` of a layer spec, for comparing two libraries' specs."""
    if isinstance(spec, type) or callable(spec) and not dataclasses.is_dataclass(spec):
        return {path: spec.__name__}
    if type(spec).__name__ == "ModuleSpec":
        return {path: spec.module.__name__, **_spec_tree(spec.submodules, path)}
    out = {}
    if dataclasses.is_dataclass(spec):
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            if value is not None and field.name != "sharded_state_dict_keys_map":
                out.update(_spec_tree(value, f"{path}.{field.name}" if path else field.name))
    return out


@pytest.mark.parametrize("num_experts", [None, 4])
def test_llava_local_spec_matches_megatron_core(num_experts):
    theirs = pytest.importorskip("megatron.core.models.multimodal.llava_spec")
    ours = llava_spec.decoder_model_with_local_default_spec(num_experts=num_experts, qk_layernorm=True)
    ref = theirs.decoder_model_with_local_default_spec(num_experts=num_experts, qk_layernorm=True)
    ours_tree, ref_tree = _spec_tree(ours), _spec_tree(ref)
    if num_experts is None:
        assert ours_tree == ref_tree
    else:  # the MoE block's insides are this library's; the layer around it is the same
        assert {k: v for k, v in ours_tree.items() if not k.startswith("mlp.")} == \
            {k: v for k, v in ref_tree.items() if not k.startswith("mlp.")}
        assert ours_tree["mlp"] == ref_tree["mlp"] == "MoELayer"
    assert ours.submodules.sharded_state_dict_keys_map == {}


def test_llava_local_spec_builds_a_layer_and_te_spec_needs_te():
    from megatron_core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    layer = build_module(llava_spec.decoder_model_with_local_default_spec(), config=_tiny_config(), layer_number=1)
    keys = set(layer.state_dict())
    assert {"input_layernorm.weight", "self_attention.linear_qkv.weight", "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.weight"} <= keys
    out, _ = layer(torch.randn(4, 2, 16), attention_mask=None)
    assert out.shape == (4, 2, 16)
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="te"):
            llava_spec.decoder_model_with_transformer_engine_default_spec()
    else:
        spec = llava_spec.decoder_model_with_transformer_engine_default_spec(qk_layernorm=True)
        assert isinstance(spec, ModuleSpec) and spec.submodules.self_attention.submodules.q_layernorm is not None


def test_cuda_graph_scope_keeps_megatron_core_values():
    theirs = pytest.importorskip("megatron.core.transformer.enums").CudaGraphScope
    assert {m.name: m.value for m in enums.CudaGraphScope} == {
        **{m.name: m.value for m in theirs}, "full_iteration_inference": 8}
    assert enums.CudaGraphScope.attn.value != enums.CudaGraphModule.attn.value


# --- weighted MoE activations ----------------------------------------------------------------------------------
def _grads(fn, *tensors, grad):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(grad)
    return out, [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("clamp", [None, 1.5])
def test_weighted_quick_geglu_matches_megatron_core(eager_megatron, with_bias, clamp):
    theirs = pytest.importorskip("megatron.core.fusions.fused_bias_geglu").weighted_bias_quick_geglu_impl
    torch.manual_seed(0)
    y, w = torch.randn(6, 8, dtype=torch.float64), torch.rand(6, 1, dtype=torch.float64)
    bias = torch.randn(8, dtype=torch.float64) if with_bias else None
    g = torch.randn(6, 4, dtype=torch.float64)
    tensors = (y, w) if bias is None else (y, w, bias)

    def call(impl):
        return lambda y, w, b=None: impl(y, b, w, False, 0.5, clamp)

    out, grads = _grads(call(fused_bias_geglu.weighted_bias_quick_geglu_impl), *tensors, grad=g)
    ref, ref_grads = _grads(call(theirs), *tensors, grad=g)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
    # and against plain autograd of the formula
    gate, up = y.chunk(2, -1)  # the clamp applies to the input, before the bias
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    if bias is not None:
        gate, up = gate + bias[:4], up + bias[4:]
    torch.testing.assert_close(out, gate * torch.sigmoid(1.702 * gate) * (up + 0.5) * w)


def test_weighted_squared_relu_matches_megatron_core(eager_megatron):
    theirs = pytest.importorskip("megatron.core.fusions.fused_weighted_squared_relu").weighted_squared_relu_impl
    torch.manual_seed(1)
    x, w = torch.randn(3, 2, 5, dtype=torch.float64), torch.rand(6, 1, dtype=torch.float64)
    g = torch.randn(3, 2, 5, dtype=torch.float64)
    out, grads = _grads(fused_weighted_squared_relu.weighted_squared_relu_impl, x, w, grad=g)
    ref, ref_grads = _grads(theirs, x, w, grad=g)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(out, F.relu(x) ** 2 * w.view(3, 2, 1))
    with pytest.raises(ValueError, match="one value per token"):
        fused_weighted_squared_relu.weighted_squared_relu_impl(x, torch.rand(5, 1))


def test_fused_cross_entropy_steps_match_megatron_core(eager_megatron):
    theirs = pytest.importorskip("megatron.core.fusions.fused_cross_entropy")
    torch.manual_seed(2)
    logits, target = torch.randn(3, 2, 10), torch.randint(0, 20, (3, 2))  # this rank holds vocab ids 10..19
    steps = []
    for module in (fused_cross_entropy, theirs):  # (Megatron-Core's steps work in place: clone what is kept)
        shifted, logits_max = module.calculate_logits_max(logits.clone())
        mask, masked_1d, both, exp_logits = module.calculate_predicted_logits(shifted, target, logits_max, 10, 20)
        softmax, loss = module.calculate_cross_entropy_loss(exp_logits, both.clone())
        kept = [t.clone() for t in (logits_max, mask, masked_1d, both, softmax, loss)]
        steps.append((*kept, module.calculate_gradients(softmax, torch.ones(3, 2), mask, masked_1d)))
    for a, b in zip(*steps):
        torch.testing.assert_close(a, b)
    assert steps[0][-1].dtype == torch.bfloat16


# --- small helpers ---------------------------------------------------------------------------------------------
def test_cat_with_oom_fallback(monkeypatch, caplog):
    pieces = [torch.ones(2, 3), torch.zeros(1, 3)]
    torch.testing.assert_close(transformer_utils.cat_with_oom_fallback(pieces), torch.cat(pieces))
    real_cat = torch.cat

    def device_cat_fails(tensors, *args, **kwargs):
        if not getattr(device_cat_fails, "failed", False):
            device_cat_fails.failed = True
            raise torch.OutOfMemoryError("out of memory")
        return real_cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", device_cat_fails)
    with caplog.at_level(logging.WARNING):
        merged = transformer_utils.cat_with_oom_fallback(pieces)
    torch.testing.assert_close(merged, real_cat(pieces))
    assert "on the CPU" in caplog.text
    monkeypatch.setattr(torch, "cat", real_cat)
    with pytest.raises(RuntimeError):  # not a memory problem: it reappears
        transformer_utils.cat_with_oom_fallback([torch.ones(2, 3), torch.ones(2, 4)])


def test_typing_variables():
    assert isinstance(identity_op.T, typing.TypeVar)
    assert identity_op.IdentityOp()(5) == 5
    for name in ("R_co", "R_src", "R_dst", "First_dst"):
        assert isinstance(getattr(typed_torch, name), typing.TypeVar)
    for name in ("P", "P_src", "P_dst"):
        assert isinstance(getattr(typed_torch, name), typing.ParamSpec)
    assert typed_torch.R_co.__covariant__
