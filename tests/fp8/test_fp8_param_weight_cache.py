"""The FP8 parameters' transposed codes cached across a step's micro-batches (``is_first_microbatch``), on CPU.

As Transformer Engine's FP8 weights: the schedules' ``set_is_first_microbatch`` makes each FP8 layer refresh its
weight's transposed codes (the data-gradient GEMM's operand) in the step's first forward and reuse them in the
other micro-batches' backward passes; a layer that is never told where steps begin transposes in every backward.

* A tiny llama-like GPT with FP8 parameters under DDP + the distributed optimizer, 3 steps of 3 micro-batches through
  ``forward_backward_no_pipelining`` (which calls ``set_is_first_microbatch``) against the same steps through a
  plain loop (no cache): every loss, ``main_grad`` and FP8 byte equal bit for bit, so the cache was refreshed after
  each optimizer step (a stale cache would give the second step's data gradients from the first step's weights).
* The layer-level rules: the refresh happens in the first forward only, a checkpoint load forces the next one, a
  device move drops the cache (GPU), and a compiled (``fullgraph``) forward/backward with the flag True, then False, gives
  the eager numbers.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.distributed import (
    finalize_model_grads,
)
from megatron_core.distributed.fp8_params import is_fp8_param
from megatron_core.fp8 import convert_to_float8
from megatron_core.fp8.fp8_param_linear import allocate_weight_transpose
from megatron_core.pipeline_parallel import forward_backward_no_pipelining
from tests.dist_harness import run_on_ranks
from tests.fp8.fp8_param_layer import OneFP8WeightLayer, emulated_fp8_ddp
from tests.models.gpt_test_utils import build, llama_like
from tests.pipeline_parallel.gpt_stages import MBS, SEQ, gpt_forward_step, make_batches

SPEC = llama_like(fp8="hybrid", fp8_recipe="tensorwise")
STEPS, MICRO = 3, 3


def _train(use_schedule: bool) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        torch.manual_seed(0)
        model = build(SPEC, fp8_param=True)
        ddp, opt = emulated_fp8_ddp(model, fp8_param=True)
        batches = make_batches(MICRO, seed=5)
        losses, grads = [], []
        for _ in range(STEPS):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            if use_schedule:
                out = forward_backward_no_pipelining(
                    forward_step_func=gpt_forward_step, data_iterator=iter(batches), model=ddp,
                    num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=MBS)
                losses += [d["lm loss"] for d in out]
            else:
                for b in batches:
                    output, loss_func = gpt_forward_step(iter([b]), ddp)
                    loss, logged = loss_func(output)
                    (loss / MICRO).backward()
                    losses.append(logged["lm loss"])
            grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
            finalize_model_grads([ddp])
            assert opt.step()[0]
        fp8 = [p for p in model.parameters() if is_fp8_param(p)]
        return dict(losses=torch.stack(losses), grads=grads, fp8=[p.detach().view(torch.uint8).clone() for p in fp8],
                    cached=[hasattr(p, "fp8_transpose") for p in fp8])
    finally:
        parallel_state.destroy_model_parallel()


def _both() -> tuple[dict, dict]:
    return _train(use_schedule=True), _train(use_schedule=False)


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(1, _both, timeout=200)[0]


def test_cached_transposes_train_bit_for_bit_as_the_uncached_backward(runs):
    cached, plain = runs
    assert len(cached["cached"]) == 8 and all(cached["cached"])  # qkv, proj, fc1, fc2 of both layers
    assert not any(plain["cached"])  # no schedule, no cache
    assert torch.equal(cached["losses"], plain["losses"]), (cached["losses"], plain["losses"])
    for step, (got, want) in enumerate(zip(cached["grads"], plain["grads"])):
        for name, value in want.items():
            assert value.abs().max() > 0, name
            assert torch.equal(got[name], value), (step, name)
    for got, want in zip(cached["fp8"], plain["fp8"]):
        assert torch.equal(got, want)
    assert not torch.equal(cached["grads"][0]["decoder.layers.0.mlp.linear_fc1.weight"],
                           cached["grads"][2]["decoder.layers.0.mlp.linear_fc1.weight"])  # the weights moved


def _run(module: torch.nn.Module, layer: OneFP8WeightLayer, x: torch.Tensor, grad: torch.Tensor):
    layer.weight.main_grad = torch.zeros(32, 48)
    layer.weight.grad_added_to_main_grad, layer.weight.grad = False, None
    xx = x.clone().requires_grad_()
    out = module(xx)
    out.backward(grad)
    return out.detach(), xx.grad, layer.weight.main_grad


def test_the_first_forward_refreshes_the_cache_and_the_others_reuse_it():
    torch.manual_seed(0)
    layer = OneFP8WeightLayer()
    allocate_weight_transpose(layer.weight)
    cache = layer.weight.fp8_transpose
    x, grad = torch.randn(2, 10, 48), torch.randn(2, 10, 32)
    reference = _run(layer, layer, x, grad)  # flag None: the backward transposes, the cache is not touched
    cache.view(torch.uint8).fill_(0)
    layer.is_first_microbatch = True
    first = _run(layer, layer, x, grad)
    assert layer.is_first_microbatch is False
    assert torch.equal(cache.view(torch.uint8), layer.weight.detach().t().contiguous().view(torch.uint8))
    second = _run(layer, layer, x, grad)
    for a, b, c in zip(reference, first, second):
        assert a.abs().max() > 0 and torch.equal(a, b) and torch.equal(a, c)
    # The cache is what the backward reads: bytes changed behind its back (not through a step's first forward)
    # change the data gradient; this is the contract set_is_first_microbatch keeps.
    cache.view(torch.uint8).fill_(0)
    assert _run(layer, layer, x, grad)[1].abs().max() == 0


def test_a_compiled_layer_refreshes_then_reuses_the_cache_as_eagerly():
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = OneFP8WeightLayer()
    allocate_weight_transpose(layer.weight)
    x, grad = torch.randn(2, 10, 48), torch.randn(2, 10, 32)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    results = []
    for module in (layer, compiled):
        layer.weight.fp8_transpose.view(torch.uint8).fill_(0)
        layer.is_first_microbatch = True
        results.append([_run(module, layer, x, grad), _run(module, layer, x, grad)])
        assert layer.is_first_microbatch is False
    for eager, traced in zip(*results):
        for a, b in zip(eager, traced):
            assert a.abs().max() > 0 and torch.equal(a, b)


def _load_and_move(device: str) -> tuple[bool, bool, bool]:
    torch.manual_seed(0)
    model = build(SPEC, fp8_param=True)
    convert_to_float8(model, emulate=True)
    model.set_is_first_microbatch()
    fc1 = model.decoder.layers[0].mlp.linear_fc1
    allocated = fc1.is_first_microbatch is True and hasattr(fc1.weight, "fp8_transpose")
    fc1.is_first_microbatch = False
    model.load_state_dict(model.state_dict())
    refreshed = fc1.is_first_microbatch is True and hasattr(fc1.weight, "fp8_transpose")
    if device == "cpu":
        return allocated, refreshed, True
    model.to(torch.device(device))
    return allocated, refreshed, not hasattr(fc1.weight, "fp8_transpose")


def _load_and_move_on_a_rank(device: str) -> tuple[bool, bool, bool]:
    parallel_state.initialize_model_parallel()
    try:
        return _load_and_move(device)
    finally:
        parallel_state.destroy_model_parallel()


def test_a_checkpoint_load_forces_a_refresh():
    assert run_on_ranks(1, _load_and_move_on_a_rank, "cpu")[0] == (True, True, True)


@pytest.mark.gpu
def test_a_device_move_drops_the_cache(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.cuda_process_group import one_rank_nccl_group

    with one_rank_nccl_group(tmp_path):
        assert _load_and_move("cuda") == (True, True, True)
