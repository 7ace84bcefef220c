"""The MoE experts' FP8 weight operands cached across a step's micro-batches (``is_first_microbatch``), on CPU.

A tiny Mixtral-like GPT (grouped experts, FP8 tensorwise, emulated) under DDP + the distributed optimizer trains 3
steps of 3 micro-batches, the model told where each step begins (``set_is_first_microbatch``, as the schedules do),
against the same steps without the flag (every forward casts the experts' weights, every backward transposes their
codes): every loss and ``main_grad`` equal bit for bit, with high-precision expert weights (cached: codes, scales and
transposed codes) and with FP8 expert parameters (cached: transposed codes). The weights move between steps, so a
cache not refreshed at a step's start would give other numbers. Then the cache is shown to be what the GEMMs read
(bytes changed behind its back change the results), a checkpoint load forces the next refresh, and a layer compiled
with ``fullgraph=True`` refreshes in its first forward and then reuses the cache, with the eager numbers.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.distributed import (
    finalize_model_grads,
)
from megatron_core.distributed.fp8_params import is_fp8_param, make_fp8_param
from megatron_core.fp8 import fp8_grouped_gemm
from megatron_core.fp8.fp8_param_grouped import fp8_param_grouped_gemm
from megatron_core.fp8.grouped_weight_cache import (
    allocate_grouped_weight_caches,
    cached_grouped_weight_operands,
)
from tests.dist_harness import run_on_ranks
from tests.fp8.fp8_param_layer import emulated_fp8_ddp
from tests.transformer.moe.moe_parallel_utils import batches, build

pytest.importorskip("torchao.float8")

FP8 = dict(fp8="e4m3", fp8_recipe="tensorwise", moe_grouped_gemm=True, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
STEPS, MICRO = 3, 3


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith(("experts.linear_fc1", "experts.linear_fc2"))]


def _cache_of(layer: torch.nn.Module) -> list[torch.Tensor]:
    cached = getattr(layer.weight, "fp8_transpose", None)
    return [cached] if cached is not None else list(getattr(layer, "fp8_weight_codes", ()))


def _train(fp8_param: bool, use_flag: bool) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        torch.manual_seed(0)
        model = build("mixtral", fp8_param=fp8_param, **FP8)
        ddp, opt = emulated_fp8_ddp(model, fp8_param)
        data = batches(MICRO, seed=5)
        losses, grads = [], []

        def micro_batch(ids, pos, labels) -> torch.Tensor:
            loss = ddp(ids, pos, None, labels=labels).float().mean()
            (loss / MICRO).backward()
            return loss.detach()

        for _ in range(STEPS):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            if use_flag:
                model.set_is_first_microbatch()
            losses += [micro_batch(*b) for b in data]
            grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
            finalize_model_grads([ddp])
            assert opt.step()[0]
        experts = _experts(model)
        result = dict(losses=torch.stack(losses), grads=grads, cached=[bool(_cache_of(m)) for m in experts])
        if use_flag:
            # The cache is what the GEMMs read: zeroed behind its back (no step start), the results change.
            ddp.zero_grad_buffer()
            before = micro_batch(*data[0])
            grads_before = {n: p.main_grad.clone() for n, p in model.named_parameters()}
            for layer in experts:
                for t in _cache_of(layer):
                    t.view(torch.uint8).zero_() if t.dtype != torch.float32 else t.fill_(1.0)
            ddp.zero_grad_buffer()
            after = micro_batch(*data[0])
            changed = [not torch.equal(p.main_grad, grads_before[n]) for n, p in model.named_parameters()]
            result["cache_read"] = (not torch.equal(before, after)) or any(changed)
            # A checkpoint load puts the next forward back to refreshing.
            assert all(m.is_first_microbatch is False for m in experts)
            model.load_state_dict(model.state_dict())
            result["refresh_after_load"] = all(m.is_first_microbatch is True for m in experts)
        return result
    finally:
        parallel_state.destroy_model_parallel()


def _all_runs() -> dict:
    return {(fp8_param, flag): _train(fp8_param, flag) for fp8_param in (False, True) for flag in (True, False)}


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(1, _all_runs, timeout=200)[0]


@pytest.mark.parametrize("fp8_param", [False, True], ids=["hp_weights", "fp8_params"])
def test_cached_operands_train_bit_for_bit_as_casting_every_pass(runs, fp8_param):
    cached, plain = runs[(fp8_param, True)], runs[(fp8_param, False)]
    assert len(cached["cached"]) == 4 and all(cached["cached"])  # fc1, fc2 of both layers
    assert not any(plain["cached"])  # no flag, no cache
    assert torch.equal(cached["losses"], plain["losses"]), (cached["losses"], plain["losses"])
    for step, (got, want) in enumerate(zip(cached["grads"], plain["grads"])):
        for name, value in want.items():
            assert torch.equal(got[name], value), (step, name)
    name = "decoder.layers.0.mlp.experts.linear_fc1.weight"
    assert cached["grads"][0][name].abs().max() > 0
    assert not torch.equal(cached["grads"][0][name], cached["grads"][2][name])  # the weights moved between steps


@pytest.mark.parametrize("fp8_param", [False, True], ids=["hp_weights", "fp8_params"])
def test_the_gemms_read_the_cache_and_a_load_forces_a_refresh(runs, fp8_param):
    cached = runs[(fp8_param, True)]
    assert cached["cache_read"]
    assert cached["refresh_after_load"]


class _OneGroupedWeight(torch.nn.Module):
    """A grouped FP8 GEMM layer reduced to its weight and the cache (emulated FP8, fixed groups)."""

    is_first_microbatch = None
    COUNTS = [16, 0, 32, 16]

    def __init__(self, fp8_param: bool) -> None:
        super().__init__()
        weight = torch.nn.Parameter(torch.randn(4, 32, 16, generator=torch.Generator().manual_seed(0)) * 0.05)
        self.weight = make_fp8_param(weight, scaling="rowwise") if fp8_param else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cached = cached_grouped_weight_operands(self)
        if is_fp8_param(self.weight):
            return fp8_param_grouped_gemm(x, self.weight, counts=self.COUNTS, emulate=True, weight_t=cached)
        return fp8_grouped_gemm(x, self.weight, counts=self.COUNTS, emulate=True, weight_codes=cached)


@pytest.mark.parametrize("fp8_param", [False, True], ids=["hp_weights", "fp8_params"])
def test_a_compiled_layer_refreshes_then_reuses_the_cache_as_eagerly(fp8_param):
    torch._dynamo.reset()
    layer = _OneGroupedWeight(fp8_param)
    gen = torch.Generator().manual_seed(1)
    x, grad = torch.randn(64, 16, generator=gen), torch.randn(64, 32, generator=gen)

    def run(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
        xx = x.clone().requires_grad_()
        layer.weight.grad = None
        if fp8_param:
            layer.weight.main_grad, layer.weight.grad_added_to_main_grad = torch.zeros(4, 32, 16), False
        out = module(xx)
        out.backward(grad)
        weight_grad = layer.weight.main_grad if fp8_param else layer.weight.grad
        return out.detach(), xx.grad, weight_grad.clone()

    reference = run(layer)  # no flag: cast in the forward, transposed in the backward
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    allocate_grouped_weight_caches(layer)
    layer.is_first_microbatch = True
    first = run(compiled)
    assert layer.is_first_microbatch is False
    second = run(compiled)
    for want, got_first, got_second in zip(reference, first, second):
        assert want.abs().max() > 0 and torch.equal(got_first, want) and torch.equal(got_second, want)


@pytest.mark.parametrize("fp8_param", [False, True], ids=["hp_weights", "fp8_params"])
def test_inductor_refreshes_the_cache_in_place_without_copies(fp8_param):
    """Compiled by Inductor, the first micro-batch's refresh is the opaque op called on the cache's own buffers:
    no temporary codes copied into them afterwards (on a GPU such copies of one-byte elements cost about as much
    as the casts they follow)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    layer = _OneGroupedWeight(fp8_param)
    allocate_grouped_weight_caches(layer)
    layer.is_first_microbatch = True
    buffers = _cache_of(layer)
    pointers = [t.data_ptr() for t in buffers]
    before = [t.clone() for t in buffers]

    def refresh() -> torch.Tensor:
        cached = cached_grouped_weight_operands(layer)  # a tuple, or an FP8 parameter's transposed codes alone
        return torch.stack([t.float().sum() for t in ([cached] if torch.is_tensor(cached) else cached)])

    sums, (code,) = run_and_get_code(torch.compile(refresh, fullgraph=True))
    op = "fp8_refresh_transposed_codes_" if fp8_param else "fp8_refresh_grouped_weight_codes_"
    assert f"torch.ops.megatron_core.{op}.default(" in code
    assert ".copy_(" not in code and "aten.copy" not in code
    assert layer.is_first_microbatch is False
    assert [t.data_ptr() for t in buffers] == pointers
    assert any(not torch.equal(b.view(torch.uint8) if b.element_size() == 1 else b,
                               t.view(torch.uint8) if t.element_size() == 1 else t) for b, t in zip(before, buffers))
    assert torch.equal(sums, torch.stack([t.float().sum() for t in buffers]))


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_cached_expert_operands_give_the_uncached_numbers(compiled):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs Hopper FP8 grouped GEMMs")
    class Layer(torch.nn.Module):
        is_first_microbatch = None

        def __init__(self) -> None:
            super().__init__()
            w = torch.randn(4, 256, 128, device="cuda", generator=gen) * 0.05
            self.weight = torch.nn.Parameter(w.to(torch.bfloat16))

        def forward(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
            return fp8_grouped_gemm(x, self.weight, ends=ends, weight_codes=cached_grouped_weight_operands(self))

    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = Layer()
    ends = torch.tensor([64, 64, 192, 256], device="cuda", dtype=torch.int32)
    x = torch.randn(256, 128, device="cuda", generator=gen).to(torch.bfloat16)
    grad = torch.randn(256, 256, device="cuda", generator=gen).to(torch.bfloat16)
    run = torch.compile(layer) if compiled else layer

    def step() -> tuple[torch.Tensor, ...]:
        xx = x.clone().requires_grad_()
        layer.weight.grad = None
        out = run(xx, ends)
        out.backward(grad)
        return out.detach(), xx.grad, layer.weight.grad

    reference = step()  # flag None: the weight cast in the forward, its codes transposed in the backward
    allocate_grouped_weight_caches(layer)
    layer.is_first_microbatch = True
    first = step()
    assert layer.is_first_microbatch is False
    second = step()
    for want, got_first, got_second in zip(reference, first, second):
        assert want.abs().max() > 0
        assert torch.equal(got_first, want) and torch.equal(got_second, want)
