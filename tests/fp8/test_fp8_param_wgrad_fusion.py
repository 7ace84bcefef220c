"""FP8 parameters with ``gradient_accumulation_fusion`` (CPU, float8 emulated in fp32, one process).

With fusion on, the high-precision weights (embedding, output layer, norms) take the fused weight-gradient path
into ``main_grad`` while the FP8 layers add their own gradients, as in Megatron-LM with Transformer Engine. Under
DDP's ``overwrite_main_grad_on_first_wgrad`` the fused weights' first GEMM of a step writes their ``main_grad``
unzeroed; an FP8 parameter's GEMM only adds, so it must not carry the fused mark its layer gave the weight it
replaced. A tiny GPT trains 3 steps of 2 micro-batches with fusion (and the overwrite) against the same run
without fusion, the gradient buffers filled with NaN before each zeroing: losses and the fp32 main weights agree
within fp32 summation order, and every FP8 weight's bytes and scale are equal.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.distributed.fp8_params import is_fp8_param
from megatron_core.fp8 import convert_to_float8
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, llama_like

SPEC = llama_like(fp8="e4m3", fp8_recipe="tensorwise")
STEPS, MICROBATCHES, LR = 3, 2, 1e-2


def _train(fusion: bool) -> dict:
    torch.manual_seed(0)
    model = build(SPEC, fp8_param=True, gradient_accumulation_fusion=fusion)
    convert_to_float8(model, emulate=True)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, fp8_param_gather=True, overwrite_main_grad_on_first_wgrad=fusion), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, use_distributed_optimizer=True), [ddp])
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        for buffer in ddp.buffers:
            buffer.grad_data.fill_(float("nan"))
        ddp.zero_grad_buffer()
        for micro in range(MICROBATCHES):
            ids, pos, labels = batch(3 + micro)
            loss = ddp(ids, pos, None, labels=labels).float().mean() / MICROBATCHES
            loss.backward()
            losses.append(loss.detach().clone())
        finalize_model_grads([ddp])
        assert opt.step()[0]
    fp8 = {n: (p.detach().view(torch.uint8).clone(), p.fp8_scale.clone())
           for n, p in model.named_parameters() if is_fp8_param(p)}
    names = {id(p): n for n, p in model.named_parameters()}
    main = {names[id(e.model_param)]: e.main_param.detach().clone() for e in opt._entries()}
    fused_marks = {n for n, p in model.named_parameters() if getattr(p, "wgrad_fused_into_main_grad", False)}
    return dict(losses=torch.stack(losses), fp8=fp8, main=main, fused_marks=fused_marks)


def _both() -> dict:
    parallel_state.initialize_model_parallel()
    try:
        return {fusion: _train(fusion) for fusion in (False, True)}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_on_ranks(1, _both, timeout=240)[0]


def test_fusion_marks_the_high_precision_weights_and_not_the_fp8_ones(runs):
    fused = runs[True]
    assert fused["fused_marks"] >= {"embedding.word_embeddings.weight", "output_layer.weight"}
    assert not fused["fused_marks"] & set(fused["fp8"]), fused["fused_marks"] & set(fused["fp8"])
    assert len(fused["fp8"]) == 8 and not runs[False]["fused_marks"]


def test_fp8_param_trains_the_same_with_fused_weight_gradients(runs):
    plain, fused = runs[False], runs[True]
    assert torch.isfinite(fused["losses"]).all()
    torch.testing.assert_close(fused["losses"], plain["losses"], rtol=1e-5, atol=0)
    assert plain["losses"][-1] < plain["losses"][0]  # it trains
    assert fused["main"].keys() == plain["main"].keys()
    for name, want in plain["main"].items():
        torch.testing.assert_close(fused["main"][name], want, rtol=1e-5, atol=1e-6, msg=name)
    for name, (codes, scale) in plain["fp8"].items():
        got_codes, got_scale = fused["fp8"][name]
        torch.testing.assert_close(got_scale, scale, rtol=1e-6, atol=0, msg=name)
        assert (got_codes != codes).float().mean() <= 1e-3, name  # a byte on a rounding boundary may flip


def test_torchao_fp8_still_refuses_fusion():
    model = build(SPEC, gradient_accumulation_fusion=True)
    with pytest.raises(ValueError, match="gradient_accumulation_fusion=True only with fp8_param=True"):
        convert_to_float8(model, emulate=True)
