"""``fp8_wgrad=False`` (Megatron-Core's high-precision weight gradient) in this library's own FP8 GEMMs.

With ``fp8_wgrad=False`` the weight-gradient GEMM takes the unquantized input ``x`` and output gradient ``dy``; the
forward and data-gradient GEMMs stay FP8. Checked for the MoE experts' grouped GEMMs (high-precision weights and FP8
expert parameters, the CPU emulation and the Hopper path), the dense FP8-parameter GEMM (with and without its fused
SwiGLU), and whole models.

* CPU (fp32 emulation; the Hopper path with ``torch._scaled_grouped_mm`` / ``torch._grouped_mm`` replaced by fp32
  statements of what they compute, after PyTorch's own argument checks): the weight gradient (``.grad`` or what is
  added to ``main_grad``) equals ``dy_e.T @ x_e`` per expert in float64 within 1e-6 relative to its largest value
  (an expert without tokens: zeros), while the output and the input gradient equal the ``fp8_wgrad=True`` path's bit
  for bit; the FP8 weight gradient does differ from it (by more than 1e-3). Eager and under
  ``torch.compile(fullgraph=True)`` (``aot_eager``), bit for bit.
* A tiny MoE GPT, 3 Adam steps on one batch: with the delayed recipe (high-precision weights, ``.grad``) and with
  FP8 parameters under DDP + the distributed optimizer (``main_grad``), every converted layer's weight gradient
  equals ``dy.T @ x`` of the tensors its GEMMs saw (1e-6), and the loss falls.
* Configuration: torchao's recipes still refuse ``fp8_wgrad=False``; ``fp8_param`` and ``'delayed'`` accept it.
* GPU (Hopper for the grouped GEMMs, compute capability >= 8.9 for the dense one; bf16): the weight gradient within
  1e-2 relative (norm) of the fp32 ``dy.T @ x``, the output and input gradient equal the ``fp8_wgrad=True`` path's,
  eager and compiled with Inductor (``fullgraph=True``).
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
from megatron_core.distributed.fp8_params import is_fp8_param, make_fp8_param
from megatron_core.fp8 import check_fp8_config, convert_to_float8, fp8_param_linear, grouped_layers, layers
from megatron_core.fp8 import fp8_param_grouped as fpg
from megatron_core.fp8 import scaled_grouped_mm as sgm
from megatron_core.fp8.fp8_param_linear import SWIGLU, Float8ParamMatmul
from megatron_core.fp8.grouped_gemm import fp8_grouped_gemm
from megatron_core.fp8.swiglu_grad_cast import swiglu_grad
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.fp8.fp8_param_layer import OneFP8WeightLayer
from tests.fp8.test_fp8_scaled_grouped_mm import _reference_kernel
from tests.transformer.moe.moe_parallel_utils import batches, build

COUNTS = [48, 0, 80, 16]  # uneven, one expert without tokens; multiples of 16 (the Hopper layout)
ODD_COUNTS = [7, 0, 21, 4]  # the emulation takes any counts
TOL = 1e-6
STEPS = 3
MOE = dict(moe_grouped_gemm=True, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to ``want``'s largest value."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30)).item()


def _norm_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _grouped_reference(dy: torch.Tensor, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``dy_e.T @ x_e`` per expert in float64 (zeros for an expert without rows)."""
    ends = torch.tensor(counts).cumsum(0).tolist()
    starts = [0] + ends[:-1]
    return torch.stack([dy[s:e].double().t() @ x[s:e].double() for s, e in zip(starts, ends)])


def _grouped_operands(counts: list[int], dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """``x [M, 64]`` (one expert's rows 100 times larger), ``w [E, 32, 64]``, ``dy [M, 32]``."""
    gen = torch.Generator().manual_seed(sum(counts))
    rows = sum(counts)
    x = torch.randn(rows, 64, generator=gen)
    x[:counts[0]] *= 100.0
    w = torch.randn(len(counts), 32, 64, generator=gen) * 0.05
    dy = torch.randn(rows, 32, generator=gen)
    return tuple(t.to(device, dtype) for t in (x, w, dy))


@torch.library.custom_op("mcore_tests::reference_grouped_mm", mutates_args=())
def _reference_grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """What ``torch._grouped_mm(a, b, offs=offs)`` computes for 2D x 2D operands (the groups split the contraction
    dimension), in the operands' dtype, after PyTorch's argument checks on bf16 stand-ins with the same strides."""
    def bf16(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.shape, t.stride(), dtype=torch.bfloat16, device="meta")

    torch._meta_registrations._meta_grouped_mm_common(bf16(a), bf16(b), None, None, offs=offs.to("meta"))
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])


@_reference_grouped_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


def _reference_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
    return _reference_grouped_mm_op(a, b, offs)


@pytest.fixture
def reference_kernels(monkeypatch):
    """The Hopper path's two grouped GEMMs replaced by their fp32 statements (CPU)."""
    monkeypatch.setattr(sgm, "_KERNEL", _reference_kernel)
    monkeypatch.setattr(sgm, "_GROUPED_MM", _reference_grouped_mm)


def _run_grouped(fn, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, fp8_wgrad: bool, compiled: bool = False,
                 backend: str = "aot_eager"):
    """``(out, dx, dW)`` of ``fn(x, w, fp8_wgrad)`` on a high-precision weight (``dW`` its ``.grad``)."""
    step = torch.compile(fn, backend=backend, fullgraph=True) if compiled else fn
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = step(xx, ww, fp8_wgrad)
    out.backward(dy)
    return out.detach(), xx.grad, ww.grad


def _run_fp8_param_grouped(fn, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, fp8_wgrad: bool,
                           compiled: bool = False, backend: str = "aot_eager"):
    """``(out, dx, main_grad - its start)`` of ``fn(x, weight, main_grad, fp8_wgrad)`` on ``w`` made an FP8 expert
    parameter whose ``main_grad`` (fp32, as DDP's) starts at ones; its autograd gradient must be the placeholder."""
    step = torch.compile(fn, backend=backend, fullgraph=True) if compiled else fn
    weight = make_fp8_param(torch.nn.Parameter(w.clone()), scaling="rowwise")
    start = torch.ones(w.shape, dtype=torch.float32, device=w.device)
    weight.main_grad, weight.grad_added_to_main_grad = start.clone(), False
    xx = x.clone().requires_grad_()
    out = step(xx, weight, weight.main_grad, fp8_wgrad)
    out.backward(dy)
    assert weight.grad is not None and weight.grad.dtype == torch.float8_e4m3fn  # DDP's hook drops it
    return out.detach(), xx.grad, weight.main_grad - start


def _assert_high_precision_wgrad(hp: tuple, fp8: tuple, want: torch.Tensor, counts: list[int]) -> None:
    """Output and input gradient as the FP8-wgrad run's bit for bit; ``dW`` as ``want`` (which the FP8 ``dW`` is
    not); empty experts' ``dW`` zero."""
    for got, ref in zip(hp[:2], fp8[:2]):
        assert ref.abs().max() > 0
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert _rel(hp[2], want) < TOL, _rel(hp[2], want)
    assert _rel(fp8[2], want) > 1e-3  # the FP8 weight gradient really is quantized
    for e, count in enumerate(counts):
        if count == 0:
            assert hp[2][e].abs().max() == 0


@pytest.mark.parametrize("counts", [ODD_COUNTS, COUNTS], ids=["odd-counts", "aligned-counts"])
def test_emulated_grouped_gemm_weight_gradient_in_high_precision(counts):
    x, w, dy = _grouped_operands(counts)

    def gemm(xx, ww, fp8_wgrad):
        return fp8_grouped_gemm(xx, ww, counts=counts, emulate=True, fp8_wgrad=fp8_wgrad)

    hp, fp8 = _run_grouped(gemm, x, w, dy, False), _run_grouped(gemm, x, w, dy, True)
    _assert_high_precision_wgrad(hp, fp8, _grouped_reference(dy, x, counts), counts)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_hopper_grouped_gemm_weight_gradient_in_high_precision(reference_kernels, compiled):
    """The Hopper path (``ScaledGroupedMm``) with its kernels' fp32 statements: ``dW`` from ``torch._grouped_mm``
    on the unquantized operands (its layout checks pass), the FP8 forward and data gradient unchanged."""
    x, w, dy = _grouped_operands(COUNTS)
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def gemm(xx, ww, fp8_wgrad):
        return sgm.ScaledGroupedMm.apply(xx, ww, ends, fp8_wgrad)

    hp = _run_grouped(gemm, x, w, dy, False, compiled)
    fp8 = _run_grouped(gemm, x, w, dy, True, compiled)
    _assert_high_precision_wgrad(hp, fp8, _grouped_reference(dy, x, COUNTS), COUNTS)
    if compiled:
        eager = _run_grouped(gemm, x, w, dy, False)
        for got, want in zip(hp, eager):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_emulated_fp8_expert_params_add_a_high_precision_weight_gradient(compiled):
    """FP8 expert parameters (emulated): ``main_grad`` grows by ``dy_e.T @ x_e``; eager and compiled agree."""
    x, w, dy = _grouped_operands(ODD_COUNTS)

    def gemm(xx, weight, main_grad, fp8_wgrad):
        return fpg.fp8_param_grouped_gemm(xx, weight, counts=ODD_COUNTS, emulate=True, fp8_wgrad=fp8_wgrad)

    hp = _run_fp8_param_grouped(gemm, x, w, dy, False, compiled)
    fp8 = _run_fp8_param_grouped(gemm, x, w, dy, True, compiled)
    _assert_high_precision_wgrad(hp, fp8, _grouped_reference(dy, x, ODD_COUNTS), ODD_COUNTS)
    if compiled:
        for got, want in zip(hp, _run_fp8_param_grouped(gemm, x, w, dy, False)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_hopper_fp8_expert_params_add_a_high_precision_weight_gradient(reference_kernels, compiled):
    """FP8 expert parameters on the Hopper path (kernels' fp32 statements): ``main_grad`` grows by the
    ``torch._grouped_mm`` product of the unquantized operands."""
    x, w, dy = _grouped_operands(COUNTS)
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def gemm(xx, weight, main_grad, fp8_wgrad):
        return fpg.ScaledGroupedMmFp8Param.apply(xx, weight, ends, weight.fp8_scale, main_grad, "empty", fp8_wgrad)

    hp = _run_fp8_param_grouped(gemm, x, w, dy, False, compiled)
    fp8 = _run_fp8_param_grouped(gemm, x, w, dy, True, compiled)
    _assert_high_precision_wgrad(hp, fp8, _grouped_reference(dy, x, COUNTS), COUNTS)


def _dense_layer(fp8_wgrad: bool) -> OneFP8WeightLayer:
    """One ``[32, 48]`` FP8 weight (emulated GEMM), the same at every call."""
    torch.manual_seed(1)
    layer = OneFP8WeightLayer()
    layer.float8_wgrad = fp8_wgrad
    return layer


def _run_dense(x: torch.Tensor, dy: torch.Tensor, fp8_wgrad: bool, activation: str | None = None,
               compiled: bool = False) -> tuple[torch.Tensor, ...]:
    """``(out, dx, main_grad - its start)`` of the FP8-parameter GEMM of :func:`_dense_layer`."""
    layer = _dense_layer(fp8_wgrad)
    start = torch.full(layer.weight.shape, 0.5)
    layer.weight.main_grad, layer.weight.grad_added_to_main_grad = start.clone(), False

    def gemm(inp: torch.Tensor):
        if activation is None:
            return fp8_param_linear.fp8_param_matmul(inp, layer.weight, layer)
        return fp8_param_linear.fp8_param_matmul(inp, layer.weight, layer, activation=activation)[0]

    step = torch.compile(gemm, backend="aot_eager", fullgraph=True) if compiled else gemm
    xx = x.clone().requires_grad_()
    out = step(xx)
    out.backward(dy)
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float8_e4m3fn  # the placeholder
    return out.detach(), xx.grad, layer.weight.main_grad - start


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_dense_fp8_param_weight_gradient_in_high_precision(compiled):
    """The dense FP8-parameter GEMM (20 tokens: the FP8 weight gradient would pad them): ``main_grad`` grows by
    ``dy.T @ x``; output and input gradient as the FP8-wgrad path's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, dy = torch.randn(2, 10, 48), torch.randn(2, 10, 32)
    hp, fp8 = _run_dense(x, dy, False, compiled=compiled), _run_dense(x, dy, True, compiled=compiled)
    want = dy.reshape(-1, 32).double().t() @ x.reshape(-1, 48).double()
    _assert_high_precision_wgrad(hp, fp8, want, [])
    if compiled:
        for got, ref in zip(hp, _run_dense(x, dy, False)):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_dense_fp8_param_with_fused_swiglu_weight_gradient_in_high_precision():
    """``activation='swiglu'`` (an MLP's fc1): ``dy`` is SwiGLU's gradient at the GEMM's output, unquantized."""
    torch.manual_seed(0)
    x, g = torch.randn(3, 20, 48), torch.randn(3, 20, 16)
    hp = _run_dense(x, g, False, activation=SWIGLU)
    fp8 = _run_dense(x, g, True, activation=SWIGLU)
    layer = _dense_layer(True)
    with torch.no_grad():  # the same FP8 forward GEMM without the activation
        pre_activation = fp8_param_linear.fp8_param_matmul(x, layer.weight, layer)
    dy = swiglu_grad(g.reshape(-1, 16), pre_activation.reshape(-1, 32))
    _assert_high_precision_wgrad(hp, fp8, dy.double().t() @ x.reshape(-1, 48).double(), [])


def test_torchao_recipes_still_refuse_fp8_wgrad_false():
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, fp8="hybrid", fp8_wgrad=False)
    with pytest.raises(ValueError, match="fp8_wgrad=False.*fp8_recipe='tensorwise'.*fp8_param=False"):
        check_fp8_config(TransformerConfig(fp8_recipe="tensorwise", **base))
    check_fp8_config(TransformerConfig(fp8_recipe="tensorwise", fp8_param=True, **base))
    check_fp8_config(TransformerConfig(fp8_recipe="delayed", **base))


class _GemmRecorder:
    """Wraps the converted layers' GEMM entry points; records each call's weight, input and output gradient."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def wrap(self, fn):
        def recorded(x, weight, *args, **kwargs):
            out = fn(x, weight, *args, **kwargs)
            call = dict(weight=weight, x=x.detach().reshape(-1, x.shape[-1]).clone(), counts=kwargs.get("counts"))
            out.register_hook(lambda g: call.update(dy=g.detach().reshape(-1, g.shape[-1]).clone()))
            self.calls.append(call)
            return out

        return recorded

    def install(self) -> list[tuple]:
        """Patch the entry points; return what to restore."""
        targets = [(layers, "fp8_param_matmul"), (layers, "delayed_float8_matmul"),
                   (grouped_layers, "fp8_grouped_gemm"), (grouped_layers, "fp8_param_grouped_gemm")]
        saved = [(module, name, getattr(module, name)) for module, name in targets]
        for module, name, fn in saved:
            setattr(module, name, self.wrap(fn))
        return saved

    def expected(self) -> dict[int, torch.Tensor]:
        """``{id(weight): sum of dy.T @ x}`` over the recorded calls (per expert for grouped ones), float64."""
        out: dict[int, torch.Tensor] = {}
        for call in self.calls:
            if call["counts"] is None:
                grad = call["dy"].double().t() @ call["x"].double()
            else:
                grad = _grouped_reference(call["dy"], call["x"], call["counts"])
            key = id(call["weight"])
            out[key] = out[key] + grad if key in out else grad
        return out


def _trace_training(model: torch.nn.Module, forward_backward, update, weight_grad) -> dict:
    """``STEPS`` steps (``forward_backward()`` returns the loss, ``update()`` steps the optimizer) with the GEMMs
    recorded; after each backward every converted weight's gradient (``weight_grad(p)``) against the recorded
    ``dy.T @ x`` (the largest relative error over the steps, by weight name)."""
    converted = {n: m for n, m in model.named_modules() if hasattr(m, "float8_wgrad")}
    names = {id(m.weight): f"{n}.weight" for n, m in converted.items()}
    recorder = _GemmRecorder()
    saved = recorder.install()
    losses, errors = [], {}
    try:
        for _ in range(STEPS):
            recorder.calls.clear()
            losses.append(forward_backward())
            grads = {id(p): weight_grad(p).clone() for p in model.parameters() if id(p) in names}
            for key, want in recorder.expected().items():
                errors[names[key]] = max(errors.get(names[key], 0.0), _rel(grads[key], want))
            update()
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
    return dict(losses=losses, errors=errors, flags={n: m.float8_wgrad for n, m in converted.items()},
                converted=sorted(names.values()))


def _delayed_model_run() -> dict:
    torch.manual_seed(0)
    model = build("mixtral", fp8="hybrid", fp8_recipe="delayed", fp8_wgrad=False, **MOE)
    convert_to_float8(model, emulate=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids, pos, labels = batches(1)[0]

    def forward_backward() -> float:
        opt.zero_grad()
        loss = model(ids, pos, None, labels=labels).float().mean()
        loss.backward()
        return loss.item()

    return _trace_training(model, forward_backward, opt.step, lambda p: p.grad)


def _fp8_param_model_run() -> dict:
    """The FP8-parameter MoE GPT under DDP + the distributed optimizer (one rank)."""
    parallel_state.initialize_model_parallel()
    try:
        torch.manual_seed(0)
        model = build("mixtral", fp8="hybrid", fp8_recipe="tensorwise", fp8_param=True, fp8_wgrad=False, **MOE)
        convert_to_float8(model, emulate=True)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, fp8_param_gather=True), model)
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [ddp])
        ids, pos, labels = batches(1)[0]

        def forward_backward() -> float:
            opt.zero_grad()
            ddp.zero_grad_buffer()
            loss = ddp(ids, pos, None, labels=labels).float().mean()
            loss.backward()
            return loss.item()

        def update() -> None:
            finalize_model_grads([ddp])
            assert opt.step()[0]

        out = _trace_training(model, forward_backward, update, lambda p: p.main_grad)
        out["fp8_params"] = sorted(n for n, p in model.named_parameters() if is_fp8_param(p))
        return out
    finally:
        parallel_state.destroy_model_parallel()


def _assert_model_run(run: dict) -> None:
    assert run["flags"] and not any(run["flags"].values()), run["flags"]  # every converted layer got fp8_wgrad=False
    assert sorted(run["errors"]) == run["converted"]  # every converted weight's GEMMs were recorded and checked
    assert any(".experts." in n for n in run["converted"]) and any("linear_qkv" in n for n in run["converted"])
    for name, error in run["errors"].items():
        assert error < TOL, (name, error)
    assert run["losses"][-1] < run["losses"][0], run["losses"]


def test_moe_gpt_delayed_recipe_trains_with_high_precision_weight_gradients():
    """The delayed recipe's dense layers and the experts' grouped GEMMs (high-precision weights, ``.grad``)."""
    _assert_model_run(_delayed_model_run())


def test_moe_gpt_fp8_params_train_with_high_precision_weight_gradients():
    """FP8 parameters, dense and experts (``main_grad``), under DDP + the distributed optimizer."""
    run = run_on_ranks(1, _fp8_param_model_run, timeout=240)[0]
    assert run["fp8_params"] == run["converted"]
    _assert_model_run(run)


def _hopper() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU (FP8 grouped GEMMs)")


def _cuda_grouped_operands() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = [48, 0, 144, 64]
    x = torch.randn(256, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    x[:48] *= 50
    w = (torch.randn(4, 768, 512, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    dy = torch.randn(256, 768, device="cuda", generator=gen, dtype=torch.bfloat16)
    return x, w, dy, counts


def _assert_cuda_high_precision_wgrad(hp: tuple, fp8: tuple, want: torch.Tensor, counts: list[int]) -> None:
    for got, ref in zip(hp[:2], fp8[:2]):
        assert torch.equal(got, ref)
    assert _norm_rel(hp[2], want) < 1e-2, _norm_rel(hp[2], want)
    assert _norm_rel(hp[2], want) < _norm_rel(fp8[2], want)  # bf16 is closer than the FP8 weight gradient
    for e, count in enumerate(counts):
        if count == 0:
            assert hp[2][e].abs().max() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_hopper_grouped_gemm_bf16_weight_gradient(compiled):
    """``ScaledGroupedMm`` on Hopper: ``dW`` from ``torch._grouped_mm`` within 1e-2 of fp32 ``dy_e.T @ x_e``."""
    _hopper()
    torch._dynamo.reset()
    x, w, dy, counts = _cuda_grouped_operands()
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)

    def gemm(xx, ww, fp8_wgrad):
        return sgm.ScaledGroupedMm.apply(xx, ww, ends, fp8_wgrad)

    hp = _run_grouped(gemm, x, w, dy, False, compiled, "inductor")
    fp8 = _run_grouped(gemm, x, w, dy, True, compiled, "inductor")
    assert hp[2].dtype == torch.bfloat16
    _assert_cuda_high_precision_wgrad(hp, fp8, _grouped_reference(dy, x, counts), counts)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_hopper_fp8_expert_params_bf16_weight_gradient(compiled):
    """FP8 expert parameters on Hopper: ``main_grad`` (fp32) grows by the bf16 grouped GEMM's ``dW``."""
    _hopper()
    torch._dynamo.reset()
    x, w, dy, counts = _cuda_grouped_operands()
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)

    def gemm(xx, weight, main_grad, fp8_wgrad):
        return fpg.ScaledGroupedMmFp8Param.apply(xx, weight, ends, weight.fp8_scale, main_grad, "empty", fp8_wgrad)

    hp = _run_fp8_param_grouped(gemm, x, w, dy, False, compiled, "inductor")
    fp8 = _run_fp8_param_grouped(gemm, x, w, dy, True, compiled, "inductor")
    _assert_cuda_high_precision_wgrad(hp, fp8, _grouped_reference(dy, x, counts), counts)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_cuda_dense_fp8_param_bf16_weight_gradient(compiled):
    """The dense FP8-parameter GEMM on a GPU with FP8 tensor cores (1000 tokens, bf16): ``main_grad`` (fp32) grows
    by the bf16 GEMM ``dy.T @ x``, within 1e-2 of fp32; output and input gradient as the FP8-wgrad path's."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 tensor cores")
    torch._dynamo.reset()
    torch.manual_seed(0)
    hp_weight = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(2, 500, 384, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2, 500, 256, device="cuda", dtype=torch.bfloat16)

    def run(fp8_wgrad: bool) -> tuple[torch.Tensor, ...]:
        weight = make_fp8_param(torch.nn.Parameter(hp_weight.clone()))
        weight.main_grad = torch.zeros(256, 384, device="cuda")
        weight.grad_added_to_main_grad = False

        def gemm(inp: torch.Tensor) -> torch.Tensor:
            return Float8ParamMatmul.apply(inp, weight, torch.float8_e5m2, None, False, weight.fp8_scale,
                                           weight.main_grad, "empty", None, None, None, fp8_wgrad)

        xx = x.clone().requires_grad_()
        out = (torch.compile(gemm, fullgraph=True) if compiled else gemm)(xx)
        out.backward(dy)
        return out.detach(), xx.grad, weight.main_grad

    want = dy.reshape(-1, 256).double().t() @ x.reshape(-1, 384).double()
    _assert_cuda_high_precision_wgrad(run(False), run(True), want, [])
