"""``get_megatron_optimizer`` with ``optimizer="muon"`` in one process: routing, config plumbing, schedule, resume.

The routing rule is Megatron-Core 0.19's (``emerging_optimizers._is_nonlinear_or_embedding``, read from its source):
a parameter goes to the scalar optimizer when it is tagged ``is_embedding_or_output_parameter`` or is not 2-D;
every other (2-D) weight goes to Muon, learned position embeddings included.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from megatron_core.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    LayerWiseDistributedOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron_core.optimizer.emerging_optimizers import TensorParallelAdaptiveMuon, TensorParallelMuon
from megatron_core.optimizer.lion import Lion
from megatron_core.optimizer.muon import get_megatron_muon_optimizer
from megatron_core.optimizer_param_scheduler import OptimizerParamScheduler
from tests.models.gpt_test_utils import batch, build, gpt2_like, llama_like

LR = 1e-2


def _model(kind: str = "gpt2", seed: int = 0):
    torch.manual_seed(seed)
    spec = llama_like() if kind == "llama" else gpt2_like()
    spec["model"] = {**spec["model"], "share_embeddings_and_output_weights": False}
    return build(spec)


def _config(**kw) -> OptimizerConfig:
    kw.setdefault("optimizer", "muon")
    kw.setdefault("muon_fp32_matmul_prec", "highest")
    return OptimizerConfig(lr=LR, weight_decay=0.1, **kw)


def _train(model, opt, steps: int, start: int = 0) -> list[float]:
    losses = []
    for i in range(start, start + steps):
        ids, pos, labels = batch(seed=i)
        opt.zero_grad()
        loss = model(ids, pos, None, labels=labels).float().mean()
        loss.backward()
        assert opt.step()[0]
        losses.append(loss.item())
    return losses


def _names(model) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def test_linear_weights_go_to_muon_and_the_rest_to_adam():
    model = _model()
    opt = get_megatron_optimizer(_config(), [model])
    assert isinstance(opt, ChainedOptimizer) and len(opt.chained_optimizers) == 2
    muon, adam = opt.chained_optimizers
    assert isinstance(muon, FP32Optimizer) and isinstance(muon.optimizer, TensorParallelMuon)
    assert isinstance(adam.optimizer, torch.optim.AdamW)
    names = _names(model)
    in_muon = {names[id(p)] for p in muon.get_parameters()}
    in_adam = {names[id(p)] for p in adam.get_parameters()}
    expected_muon = {n for n, p in model.named_parameters()
                     if p.dim() == 2 and not getattr(p, "is_embedding_or_output_parameter", False)}
    assert in_muon == expected_muon and in_adam == set(names.values()) - expected_muon
    assert "embedding.position_embeddings.weight" in in_muon  # 2-D and untagged, as in Megatron-Core
    assert {"embedding.word_embeddings.weight", "output_layer.weight",
            "decoder.layers.0.self_attention.linear_qkv.bias", "decoder.final_layernorm.weight"} <= in_adam
    assert all(g["optimizer"] == "adam" for g in adam.param_groups)
    assert all(g["wd_mult"] == 1.0 for g in muon.param_groups)
    assert {g["wd_mult"] for g in adam.param_groups} == {0.0, 1.0}  # biases / norms keep no weight decay
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.is_qkv and qkv.qkv_split_shapes == [8, 8, 8]  # 4 heads of 8, no GQA: [q, k, v] per group
    _train(model, opt, 2)


def test_config_fields_reach_the_muon_optimizer_and_lion_serves_the_rest():
    model = _model("llama")
    config = _config(muon_momentum=0.8, muon_nesterov=True, muon_coefficient_type="polar_express",
                     muon_num_ns_steps=7, muon_scale_mode="unit_rms_norm", muon_extra_scale_factor=0.2,
                     muon_tp_mode="distributed", muon_split_qkv=False, muon_scalar_optimizer="lion",
                     lion_beta1=0.9, lion_beta2=0.97)
    muon, lion = get_megatron_optimizer(config, [model]).chained_optimizers
    m = muon.optimizer
    assert (m.nesterov, m.coefficient_type, m.num_ns_steps, m.scale_mode, m.extra_scale_factor, m.tp_mode,
            m.split_qkv, m.fp32_matmul_prec, m.weight_decay_method) == (
        True, "polar_express", 7, "unit_rms_norm", 0.2, "distributed", False, "highest", "decoupled")
    assert m.param_groups[0]["momentum"] == 0.8 and m.qkv_split_shapes == [8, 4, 4]  # GQA: 2 heads per group
    assert isinstance(lion.optimizer, Lion) and lion.param_groups[0]["betas"] == (0.9, 0.97)
    _train(model, get_megatron_optimizer(config, [_model("llama")]), 2)


def test_adaptive_muon_reads_its_fields():
    opt = get_megatron_optimizer(_config(optimizer="adaptive_muon", adaptive_muon_moment2_method="normuon",
                                         adaptive_muon_beta2=0.9, adaptive_muon_eps=1e-6), [_model()])
    inner = opt.chained_optimizers[0].optimizer
    assert isinstance(inner, TensorParallelAdaptiveMuon) and inner.moment2_method == "normuon"
    assert (inner.param_groups[0]["beta2"], inner.param_groups[0]["eps"]) == (0.9, 1e-6)


def test_muon_lowers_the_loss_on_a_repeated_batch():
    model = _model()
    opt = get_megatron_optimizer(_config(), [model])
    ids, pos, labels = batch(seed=0)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = model(ids, pos, None, labels=labels).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


def test_lr_schedule_drives_muon_and_adam_groups():
    model = _model()
    config = _config(decoupled_lr=3e-3, min_lr=1e-4)
    opt = get_megatron_optimizer(config, [model])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=LR, min_lr=1e-4, lr_warmup_steps=2, lr_decay_steps=10,
                                    lr_decay_style="linear", start_wd=0.1, end_wd=0.1, wd_incr_steps=10,
                                    wd_incr_style="constant")
    sched.step(1)
    muon, adam = opt.chained_optimizers
    assert all(g["lr"] == pytest.approx(LR / 2) for g in muon.param_groups)
    embedding = [g for g in adam.param_groups if g["is_decoupled_lr"]]
    assert embedding and all(g["lr"] == pytest.approx(3e-3 / 2) for g in embedding)
    assert all(g["weight_decay"] == pytest.approx(0.1 * g["wd_mult"]) for g in opt.param_groups)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train(model, opt, 1)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(before[qkv], dict(model.named_parameters())[qkv])


def test_state_dict_round_trip_resumes():
    model = _model()
    config = _config(muon_nesterov=True, adam_eps=1e-6)  # Adam's eps: keep summation-order noise from amplifying
    opt = get_megatron_optimizer(config, [model])
    _train(model, opt, 2)
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    assert isinstance(saved, list) and "momentum_buffer" in next(iter(saved[0]["state"].values()))
    _train(model, opt, 2, start=2)
    resumed, cold = _model(seed=5), _model(seed=6)
    resumed.load_state_dict(weights)
    cold.load_state_dict(weights)
    resumed_opt = get_megatron_optimizer(config, [resumed])
    resumed_opt.load_state_dict(saved)
    _train(resumed, resumed_opt, 2, start=2)
    _train(cold, get_megatron_optimizer(config, [cold]), 2, start=2)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        # (CPU backward kernels sum in a thread-dependent order: equal to rounding, not bit-exact)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=name)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert (dict(cold.named_parameters())[qkv] - dict(model.named_parameters())[qkv]).abs().max() > 1e-3


def test_bf16_model_keeps_fp32_main_params_with_the_qkv_tags():
    ref = _model()
    model = copy.deepcopy(ref).to(torch.bfloat16)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16))  # the same starting point
    opt = get_megatron_optimizer(_config(bf16=True), [model])
    muon = opt.chained_optimizers[0]
    assert isinstance(muon, Float16OptimizerWithFloat16Params)
    mains = [p for g in muon.optimizer.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in mains) and any(getattr(p, "is_qkv", False) for p in mains)
    start = copy.deepcopy(ref.state_dict())
    _train(model, opt, 1)
    _train(ref, get_megatron_optimizer(_config(), [ref]), 1)
    for model_param, main in zip(muon.float16_groups[0], muon.fp32_from_float16_groups[0]):
        assert torch.equal(model_param, main.to(torch.bfloat16))
    for name, param in ref.named_parameters():
        if param.dim() == 2 and "embedding" not in name and "output" not in name:
            bf16_step = dict(model.named_parameters())[name].float() - start[name]
            fp32_step = param.detach() - start[name]
            assert torch.nn.functional.cosine_similarity(bf16_step.flatten(), fp32_step.flatten(), dim=0) > 0.9, name


def test_deprecated_names_and_entry_point():
    model = _model()
    with pytest.warns(DeprecationWarning, match="dist_muon.*use_layer_wise_distributed_optimizer"):
        opt = get_megatron_optimizer(_config(optimizer="dist_muon"), [model])
    assert isinstance(opt, LayerWiseDistributedOptimizer)
    assert isinstance(opt.chained_optimizers[0].optimizer, TensorParallelMuon)
    _train(model, opt, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(get_megatron_muon_optimizer(_config(), [_model()]), ChainedOptimizer)
    with pytest.raises(ValueError, match="layer_wise_distributed_optimizer=True needs optimizer='dist_muon'"):
        get_megatron_muon_optimizer(_config(), [_model()], layer_wise_distributed_optimizer=True)


@pytest.mark.parametrize("kw,match", [
    (dict(optimizer="soap"), r"optimizer \('soap'\) must be one of"),
    (dict(muon_tp_mode="rowwise"), r"muon_tp_mode \('rowwise'\) must be one of \('blockwise'"),
    (dict(muon_scale_mode="rms"), r"muon_scale_mode \('rms'\) must be one of"),
    (dict(muon_coefficient_type="custom"), r"muon_coefficient_type \('custom'\) must be one of .*'quintic'"),
    (dict(muon_coefficient_type="cubic5", muon_num_ns_steps=6), r"muon_num_ns_steps \(6\) must be 5"),
    (dict(muon_fp32_matmul_prec="low"), r"muon_fp32_matmul_prec \('low'\) must be one of"),
    (dict(muon_scalar_optimizer="sgd"), r"muon_scalar_optimizer \('sgd'\) must be one of \('adam', 'lion'\)"),
    (dict(adaptive_muon_moment2_method="namo"), r"adaptive_muon_moment2_method \('namo'\)"),
    (dict(muon_num_ns_steps=0), r"muon_num_ns_steps \(0\) must be a positive int"),
    (dict(muon_momentum=1.0), r"muon_momentum \(1.0\) must be a finite number in \[0, 1\)"),
    (dict(muon_extra_scale_factor=0.0), r"muon_extra_scale_factor \(0.0\) must be a finite positive float"),
    (dict(lion_beta2=1.5), r"lion_beta2 \(1.5\)"),
    (dict(fp16=True), r"optimizer='muon' does not support fp16=True"),
    (dict(use_distributed_optimizer=True), r"use_distributed_optimizer=True.*use_layer_wise_distributed_optimizer"),
])
def test_bad_muon_configs_name_the_fields(kw, match):
    with pytest.raises(ValueError, match=match):
        _config(**kw)


def test_earlier_keyword_arguments_are_refused_for_muon():
    with pytest.raises(ValueError, match=r"optimizer='muon' takes config_overrides.*lr_mult"):
        get_megatron_optimizer(_config(), [_model()], lr_mult=2.0)


def test_normuon_sharded_save_refuses_naming_the_state():
    """NorMuon's second moment has one value per row: a sharded save says so instead of failing in a reshape."""
    model = _model()
    opt = get_megatron_optimizer(_config(optimizer="adaptive_muon", adaptive_muon_moment2_method="normuon"),
                                 [model])
    _train(model, opt, 1)
    with pytest.raises(ValueError, match="moment2_buffer.*parameter-shaped.*normuon"):
        opt.sharded_state_dict(model.sharded_state_dict())
