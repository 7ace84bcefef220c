"""FP8 training through torchao: config rules, bad input, emulated float8 GEMMs on CPU, TP/SP, and a GPU check.

On CPU torchao's emulation mode runs the float8 casts (e4m3 rounding, per-tensor or per-row
scales) with fp32 matmuls, so the conversion, the TP/SP communication around the float8 op and
the numerics (close to, not equal to, high precision) are checked here; real FP8 GEMMs are
checked by the ``gpu`` test.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.fp8 import (
    Float8ColumnParallelLinear,
    Float8RowParallelLinear,
    check_fp8_config,
    check_fp8_device,
    convert_to_float8,
)
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, llama_like, shard

pytest.importorskip("torchao.float8")

FP8 = dict(fp8="e4m3", fp8_recipe="tensorwise")


def _loss_and_grads(model) -> tuple[torch.Tensor, dict]:
    ids, pos, labels = batch()
    loss = model(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    return loss.detach(), {k: v.grad.detach().clone() for k, v in model.named_parameters()}


def _assert_close_rel(got: dict, want: dict, tol: float) -> None:
    for name, value in got.items():
        scale = want[name].abs().max().item()
        err = (value - want[name]).abs().max().item() / scale
        assert err < tol, f"{name}: relative error {err:.3f} >= {tol}"


@pytest.mark.parametrize("kwargs, field", [
    (dict(fp8="e5m2"), "fp8"),
    (dict(fp8="e4m3", fp8_recipe="bogus"), "fp8_recipe"),
    (dict(fp8="e4m3", fp8_recipe="delayed", first_last_layers_bf16=True), "first_last_layers_bf16"),
    (dict(fp8="e4m3", fp8_recipe="tensorwise", first_last_layers_bf16=True, num_layers_at_start_in_bf16=3),
     "num_layers_at_start_in_bf16"),
    (dict(fp8="e4m3", fp8_margin=-1), "fp8_margin"),
])
def test_fp8_config_rules(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, **kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(fp8_recipe="custom"), "fp8_recipe"),
    (dict(fp8_recipe="mxfp8"), "fp8_recipe"),
    (dict(fp8_recipe="blockwise"), "fp8_recipe"),
    (dict(fp8="hybrid", fp8_recipe="rowwise"), "hybrid"),
    (dict(fp8_recipe="tensorwise", fp8_amax_history_len=16), "fp8_amax_history_len"),
    (dict(fp8_recipe="rowwise", fp8_param=True), "fp8_param"),
])
def test_torchao_backend_refuses_what_it_cannot_do(kwargs, field):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, **{"fp8": "e4m3", **kwargs})
    with pytest.raises(ValueError, match=field):
        check_fp8_config(config)


def test_fp8_needs_a_gpu_with_fp8_tensor_cores(monkeypatch):
    model = build(llama_like(**FP8))
    with pytest.raises(ValueError, match=r"fp8='e4m3'.*cpu"):
        convert_to_float8(model)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"fp8='e4m3'.*A100.*8\.0"):
        check_fp8_device(model.config, "cuda:0")
    assert all(type(m) not in (Float8ColumnParallelLinear, Float8RowParallelLinear) for m in model.modules())


def test_fp8_rejects_dimensions_not_multiple_of_16():
    model = build(llama_like(hidden_size=40, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=80, **FP8))
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.self_attention\.linear_qkv.*\(120, 40\).*16"):
        convert_to_float8(model, emulate=True)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_fp8_is_close_to_high_precision(recipe):
    torch.manual_seed(0)
    model = build(llama_like(fp8="e4m3", fp8_recipe=recipe))
    reference = build(llama_like())
    reference.load_state_dict(model.state_dict())
    names = convert_to_float8(model, emulate=True)
    assert len(names) == 8 and all(".layers." in n for n in names)  # qkv, proj, fc1, fc2 of 2 layers
    assert type(model.output_layer).__name__ == "ColumnParallelLinear"  # output layer stays high precision
    loss, grads = _loss_and_grads(model)
    ref_loss, ref_grads = _loss_and_grads(reference)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    assert not torch.equal(grads["decoder.layers.0.mlp.linear_fc1.weight"],
                           ref_grads["decoder.layers.0.mlp.linear_fc1.weight"])  # really float8-rounded
    _assert_close_rel(grads, ref_grads, 0.25)
    # No scaling state: the checkpoint of an FP8 model is the high-precision model's and loads both ways.
    assert model.state_dict().keys() == reference.state_dict().keys()
    reference.load_state_dict(model.state_dict())


def test_first_last_layers_stay_in_high_precision():
    model = build(llama_like(num_layers=4, first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                             num_layers_at_end_in_bf16=2, **FP8))
    names = convert_to_float8(model, emulate=True)
    assert {n.split(".")[2] for n in names} == {"1"}


def _tp_sp_fp8(recipe: str) -> float:
    torch.manual_seed(0)
    ref = build(llama_like(fp8="e4m3", fp8_recipe=recipe))
    state = {k: v.detach().clone() for k, v in ref.named_parameters()}
    convert_to_float8(ref, emulate=True)
    ref_loss, ref_grads = _loss_and_grads(ref)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        model = build(llama_like(fp8="e4m3", fp8_recipe=recipe), tensor_model_parallel_size=2, sequence_parallel=True)
        rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, state[name], 2, rank, True))
        convert_to_float8(model, emulate=True)
        loss, grads = _loss_and_grads(model)
        norm_grad = grads["decoder.layers.0.input_layernorm.weight"].clone()
        torch.distributed.all_reduce(norm_grad, group=parallel_state.get_tensor_model_parallel_group())
        want = ref_grads["decoder.layers.0.input_layernorm.weight"]
        assert (norm_grad - want).abs().max() / want.abs().max() < 0.1
        return abs(loss.item() - ref_loss.item()) / ref_loss.item()
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_fp8_under_tp2_with_sequence_parallel(recipe):
    errors = run_on_ranks(2, _tp_sp_fp8, recipe)
    assert max(errors) < 5e-3, errors


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_gemms_on_gpu_track_bf16(recipe):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    torch.manual_seed(0)
    kwargs = dict(hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=512,
                  bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True)  # no RNG tracker here
    model = build(llama_like(fp8="e4m3", fp8_recipe=recipe, **kwargs)).cuda()
    reference = build(llama_like(**kwargs)).cuda()
    reference.load_state_dict(model.state_dict())
    convert_to_float8(model)
    ids, pos, labels = (t.cuda() for t in batch())
    loss = model(ids, pos, None, labels=labels).float().mean()
    ref_loss = reference(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 2e-2
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
