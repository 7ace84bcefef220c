"""The FP8-parameter GEMM (``fp8_param``) under ``torch.compile(fullgraph=True)``, on CPU (fp32 emulation).

* DP=2, the input / output-gradient amaxes max-reduced over the DP group: the tiny llama-like GPT wrapped in DDP with
  the distributed optimizer compiles without a graph break (``aot_eager``), the amax all-reduce being a functional
  collective in the forward and backward graphs, the forward and input-gradient GEMMs traced and the weight-gradient
  GEMM into ``main_grad`` a custom op. One
  compiled forward/backward gives the eager loss and every parameter's ``main_grad`` within 1e-6 (relative to the
  largest; measured: equal), and the FP8 weights' autograd gradients are placeholders DDP's hook drops.
* Inductor (one layer's op, its ``main_grad`` a view into a larger buffer as DDP's): the casts it fuses give the
  eager op's output, input gradient and ``main_grad`` bit for bit.
* The ``torch._scaled_mm`` path (the GPU's; PyTorch's CPU kernel here) traced and through the weight-gradient op
  and its fake (``aot_eager``): bit for bit.
* The weight-gradient op receives its operands already transposed by the traced code (Inductor).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop

from megatron_core import parallel_state
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.distributed.fp8_params import is_fp8_param, make_fp8_param
from megatron_core.fp8 import convert_to_float8
from megatron_core.fp8.fp8_param_linear import Float8ParamMatmul
from tests.dist_harness import run_on_ranks
from tests.fp8.fp8_param_layer import OneFP8WeightLayer
from tests.models.gpt_test_utils import batch, build, llama_like

SPEC = llama_like(fp8="hybrid", fp8_recipe="tensorwise")
TOL = 1e-6


def _recording_backend(graphs: list[str]):
    """``aot_eager`` that keeps the code of every forward and backward graph it runs."""
    def record(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm.code)
        return boxed_nop(gm, example_inputs)

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def _loss_and_main_grads(ddp, module, ids, pos, labels) -> tuple[torch.Tensor, dict[str, torch.Tensor], list]:
    ddp.zero_grad_buffer()
    loss = module(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    grads = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}
    leftover = [n for n, p in ddp.module.named_parameters() if p.grad is not None]
    return loss.detach(), grads, leftover


def _eager_and_compiled() -> dict:
    parallel_state.initialize_model_parallel()
    try:
        rank = torch.distributed.get_rank()
        torch.manual_seed(0)
        model = build(SPEC, fp8_param=True)
        convert_to_float8(model, emulate=True, amax_reduction_group=parallel_state.get_data_parallel_group())
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, fp8_param_gather=True), model)
        ids, pos, labels = batch(3 + rank)  # each rank its own tokens: the reduced amaxes differ from the local ones
        eager = _loss_and_main_grads(ddp, model, ids, pos, labels)
        torch._dynamo.reset()
        graphs: list[str] = []
        compiled = torch.compile(model, backend=_recording_backend(graphs), fullgraph=True)
        traced = _loss_and_main_grads(ddp, compiled, ids, pos, labels)
        fp8_names = [n for n, p in model.named_parameters() if is_fp8_param(p)]
        return dict(eager=eager, compiled=traced, graphs=graphs, fp8_names=fp8_names)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def dp2():
    return run_on_ranks(2, _eager_and_compiled, timeout=280)


@pytest.mark.slow  # the DP=2 pool compiles the GPT on both ranks: ~35 s on 2 busy cores
def test_compiled_fp8_param_gpt_matches_eager_under_ddp(dp2):
    for rank in dp2:
        (loss, grads, leftover), (c_loss, c_grads, c_leftover) = rank["eager"], rank["compiled"]
        assert len(rank["fp8_names"]) == 8  # qkv, proj, fc1, fc2 of both layers
        torch.testing.assert_close(c_loss, loss, rtol=TOL, atol=0)
        assert grads.keys() == c_grads.keys()
        for name, want in grads.items():
            assert want.abs().max() > 0, name
            assert (c_grads[name] - want).abs().max() <= TOL * want.abs().max(), name
        assert leftover == c_leftover == []  # DDP's hook consumed every .grad (placeholders included)
    # The two ranks' losses differ (their own tokens) but the amaxes were reduced: both ran the same graphs.
    assert dp2[0]["eager"][0] != dp2[1]["eager"][0]


@pytest.mark.slow
def test_compiled_fp8_param_graphs_hold_the_gemms_the_wgrad_op_and_the_functional_amax_reduce(dp2):
    forward, backward = dp2[0]["graphs"]  # one forward and one backward graph: no graph break
    counts = {name: (forward.count(op), backward.count(op)) for name, op in (
        ("mm", "torch.ops.aten.mm.default"), ("wgrad", "megatron_core.fp8_param_wgrad_"),
        ("all_reduce", "_c10d_functional.all_reduce.default"))}
    # The forward and input-gradient GEMMs are traced (emulated here: aten.mm; torch._scaled_mm on a GPU), 8 each,
    # beside the output layer's (1 forward, 2 backward); the weight-gradient GEMMs are the custom op into main_grad.
    assert counts["mm"] == (8 + 1, 8 + 2), counts
    assert counts["wgrad"] == (0, 8), counts
    assert counts["all_reduce"] == (8, 8), counts  # the inputs' and the output gradients' amaxes


def test_inductor_fp8_param_matmul_equals_eager_bit_for_bit():
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = OneFP8WeightLayer()
    x, grad = torch.randn(2, 10, 48), torch.randn(2, 10, 32)
    results = []
    for module in (layer, torch.compile(layer, backend="inductor", fullgraph=True)):
        # DDP's hook would drop the placeholder .grad (a float8 tensor, which cannot be accumulated)
        main_grad = torch.ones(2000)[16:16 + 32 * 48].view(32, 48)
        layer.weight.main_grad, layer.weight.grad_added_to_main_grad, layer.weight.grad = main_grad, False, None
        xx = x.clone().requires_grad_()
        out = module(xx)
        out.backward(grad)
        results.append((out.detach(), xx.grad, layer.weight.main_grad))
    for eager, compiled in zip(*results):
        assert eager.abs().max() > 0 and torch.equal(compiled, eager)


def test_compiled_scaled_mm_path_equals_eager():
    """The ``torch._scaled_mm`` code of the GPU (PyTorch's CPU kernel here; 20 tokens, so the weight-gradient GEMM
    pads) through the custom ops and their fake shapes: a traced graph gives the eager numbers bit for bit."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    weight = make_fp8_param(torch.nn.Parameter(torch.randn(32, 48) * 0.05))
    weight.grad_added_to_main_grad = False
    x, grad = torch.randn(2, 10, 48), torch.randn(2, 10, 32)

    def gemm(inp: torch.Tensor) -> torch.Tensor:
        return Float8ParamMatmul.apply(inp, weight, torch.float8_e5m2, None, False, weight.fp8_scale,
                                       weight.main_grad, "empty")

    results = []
    for fn in (gemm, torch.compile(gemm, backend="aot_eager", fullgraph=True)):
        weight.main_grad, weight.grad = torch.zeros(32, 48), None
        xx = x.clone().requires_grad_()
        out = fn(xx)
        out.backward(grad)
        assert weight.grad.dtype == torch.float8_e4m3fn  # the placeholder
        results.append((out.detach(), xx.grad, weight.main_grad))
    for eager, compiled in zip(*results):
        assert eager.abs().max() > 0 and torch.equal(compiled, eager)


def test_compiled_wgrad_op_gets_its_operands_in_the_layout_scaled_mm_wants(monkeypatch):
    """Inductor makes the transposed copies of the input and the output gradient next to their casts, so the
    weight-gradient custom op receives contiguous ``[out, t]`` / ``[in, t]`` operands and ``torch._scaled_mm``'s
    layout costs no copy inside the opaque op (20 tokens, padded to 32)."""
    from megatron_core.fp8 import fp8_param_ops

    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = OneFP8WeightLayer()
    layer.weight.main_grad, layer.weight.grad_added_to_main_grad = torch.zeros(32, 48), False
    calls = []
    gemm = fp8_param_ops.dequantized_mm_nt

    def recording_gemm(a, a_scale_inv, b_t, b_scale_inv, out_dtype, emulate):
        calls.append((tuple(a.shape), tuple(b_t.shape), a.is_contiguous() and b_t.is_contiguous()))
        return gemm(a, a_scale_inv, b_t, b_scale_inv, out_dtype, emulate)

    monkeypatch.setattr(fp8_param_ops, "dequantized_mm_nt", recording_gemm)
    x = torch.randn(2, 10, 48, requires_grad=True)
    torch.compile(layer, backend="inductor", fullgraph=True)(x).backward(torch.randn(2, 10, 32))
    assert calls == [((32, 32), (48, 32), True)]  # dy_q.T @ x_q, the tokens padded to 32


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_cuda_fused_casts_give_the_plain_casts_numbers_bit_for_bit(compiled, monkeypatch):
    """On a GPU the input's and the output gradient's casts write their row-major and transposed codes in one kernel
    (``cast_transpose``): output, input gradient and ``main_grad`` equal those of the plain torch casts bit for bit,
    eager and through Inductor (1000 tokens: the transposed copies are padded)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron_core.fp8 import fp8_param_linear

    torch.manual_seed(0)
    weight = make_fp8_param(torch.nn.Parameter(torch.randn(256, 384, device="cuda", dtype=torch.bfloat16) * 0.05))
    weight.grad_added_to_main_grad = False
    x = torch.randn(2, 500, 384, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(2, 500, 256, device="cuda", dtype=torch.bfloat16)

    def gemm(inp: torch.Tensor) -> torch.Tensor:
        return Float8ParamMatmul.apply(inp, weight, torch.float8_e5m2, None, False, weight.fp8_scale,
                                       weight.main_grad, "empty")

    results = []
    for fused in (True, False):
        monkeypatch.setattr(fp8_param_linear, "FUSED_CASTS", fused)
        torch._dynamo.reset()
        weight.main_grad, weight.grad = torch.ones(256, 384, device="cuda", dtype=torch.bfloat16), None
        xx = x.clone().requires_grad_()
        out = (torch.compile(gemm, fullgraph=True) if compiled else gemm)(xx)
        out.backward(grad)
        results.append((out.detach(), xx.grad, weight.main_grad))
    for fused, plain in zip(*results):
        assert plain.abs().max() > 0 and torch.equal(fused, plain)
