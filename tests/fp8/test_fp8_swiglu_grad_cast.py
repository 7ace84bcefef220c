"""SwiGLU inside an FP8-parameter ``linear_fc1`` (``fp8.swiglu_grad_cast``, ``Float8ParamMatmul(activation=)``).

CPU: the gradient formula against autograd's; the fused function against the GEMM followed by SwiGLU (same
output bit for bit, gradients within FP8 rounding); the MLP takes the fused route only where it computes the same
function. Triton's interpreter: the kernels' amax and the layout of both codes (its float8 rounding is not the
hardware's). GPU: the kernels against the
PyTorch formula and ``cast_transpose`` on random inputs, and a compiled FP8 GPT with and without the fused route.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.fp8 import convert_to_float8, fp8_param_linear
from megatron_core.fp8.fp8_param_linear import SWIGLU, Float8ParamMatmul
from megatron_core.fp8.swiglu_grad_cast import swiglu, swiglu_grad
from tests.fp8.fp8_param_layer import OneFP8WeightLayer
from tests.models.gpt_test_utils import batch, build, llama_like
from tests.triton_interpreter import needs_triton, run_in_triton_interpreter


def test_swiglu_grad_is_autograds_gradient():
    torch.manual_seed(0)
    y = (torch.randn(40, 64, dtype=torch.float64) * 3).requires_grad_()
    g = torch.randn(40, 32, dtype=torch.float64)
    swiglu(y).backward(g)
    assert torch.allclose(swiglu_grad(g, y.detach()), y.grad, rtol=1e-6, atol=1e-6)  # computed in fp32
    gate, up = y.detach().chunk(2, -1)
    assert torch.equal(swiglu(y.detach()), F.silu(gate) * up)


def _run(activation: str | None, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    layer = OneFP8WeightLayer()
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    x = x.clone().requires_grad_()
    out = Float8ParamMatmul.apply(x, layer.weight, layer.fp8_param_grad_dtype, None, True, None, None, None, None,
                                  activation)
    if activation is None:
        out = swiglu(out)
    else:  # the output's amax comes with it, not differentiable
        out, amax = out
        assert not amax.requires_grad and amax.shape == () and amax.dtype == torch.float32
        assert torch.equal(amax, out.detach().abs().amax().float())
    out.backward(g)
    return out.detach(), x.grad, layer.weight.main_grad


def test_fused_swiglu_matches_the_gemm_then_swiglu():
    """Emulated FP8: the output bit for bit (the same ops); the data and weight gradients within one FP8 step of
    the output gradient's codes (the fused backward's ``dy`` is the fp32 formula rounded once, autograd's the
    same products in another order; measured equal here)."""
    torch.manual_seed(0)
    x, g = torch.randn(3, 20, 48), torch.randn(3, 20, 16)
    fused, plain = _run(SWIGLU, x, g), _run(None, x, g)
    assert fused[0].shape == (3, 20, 16) and torch.equal(fused[0], plain[0])
    for got, want in zip(fused[1:], plain[1:]):
        assert want.abs().max() > 0
        assert (got - want).norm() <= 2.0 ** -3 * want.norm(), ((got - want).norm(), want.norm())


def test_an_unknown_activation_is_refused():
    layer = OneFP8WeightLayer()
    with pytest.raises(ValueError, match="activation 'gelu'"):
        Float8ParamMatmul.apply(torch.randn(4, 48), layer.weight, torch.float8_e5m2, None, True, None, None, None,
                                None, "gelu")


def _mlp_route_calls(monkeypatch, **overrides) -> tuple[int, int]:
    """How many MLPs of a converted FP8-parameter GPT's forward took ``forward_swiglu``, and how many layers."""
    torch.manual_seed(0)
    model = build(llama_like(fp8="e4m3", fp8_recipe="tensorwise", **overrides), fp8_param=True)
    convert_to_float8(model, emulate=True)
    calls = []
    fc1_class = type(model.decoder.layers[0].mlp.linear_fc1)
    original = fc1_class.forward_swiglu
    monkeypatch.setattr(fc1_class, "forward_swiglu", lambda self, x: calls.append(1) or original(self, x))
    ids, pos, labels = batch(3)
    with torch.no_grad():
        model(ids, pos, None, labels=labels)
    return len(calls), len(model.decoder.layers)


def test_the_mlp_routes_swiglu_through_fp8_fc1_only_where_it_is_the_same_function(monkeypatch):
    calls, layers = _mlp_route_calls(monkeypatch)
    assert layers > 0 and calls == layers
    assert _mlp_route_calls(monkeypatch, add_bias_linear=True)[0] == 0  # a bias between the GEMM and SwiGLU
    assert _mlp_route_calls(monkeypatch, glu_linear_offset=1.0)[0] == 0
    monkeypatch.setattr(fp8_param_linear, "FUSED_SWIGLU_GRAD", False)
    assert _mlp_route_calls(monkeypatch)[0] == 0


_INTERPRETED = """
import torch
from megatron_core.fp8 import swiglu_grad_cast as sgc
sgc._CONFIGS = ((32, 32, 4),)  # one config: the autotuner's timing needs a GPU; small tiles cross the edges
gen = torch.Generator().manual_seed(0)
for rows, half, dtype in ((37, 48, torch.float8_e5m2), (64, 96, torch.float8_e4m3fn)):
    y = (torch.randn(rows, 2 * half, generator=gen) * 2).to(torch.bfloat16)
    g = torch.randn(rows, half, generator=gen).to(torch.bfloat16)
    want = sgc.swiglu_grad(g, y).float()
    amax = sgc._amax(g, y)
    assert amax.shape == () and torch.allclose(amax, want.abs().amax(), rtol=2 ** -7), (amax, want.abs().amax())
    scale = 100.0 / amax
    codes, transposed = sgc._cast(g, y, scale, dtype == torch.float8_e5m2)
    assert codes.dtype == dtype and codes.shape == (rows, 2 * half)
    padded = rows + (-rows % 16)
    assert transposed.shape == (2 * half, padded)
    assert torch.equal(transposed[:, :rows].view(torch.uint8), codes.t().contiguous().view(torch.uint8))
    assert not transposed[:, rows:].view(torch.uint8).any()
    # the interpreter's float8 conversion may lose a rounding's carry into the exponent (see test_fp8_cast_kernels):
    # each value within about a factor of two of the formula's (below e4m3's smallest subnormal: zero), with its
    # sign; the rounding is checked on the GPU
    got = codes.float() / scale
    tiny = 2.0 ** -9 / scale
    assert ((got.abs() <= 2 * want.abs() + tiny) & (got.abs() >= want.abs() / 2.1 - tiny)).all()
    assert (got * want >= 0).all()
"""


@needs_triton
def test_interpreted_kernels_give_the_amax_and_both_layouts():
    run_in_triton_interpreter(_INTERPRETED)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_gpu_kernels_equal_the_formula_then_cast_transpose(dtype):
    """Random bf16 inputs: the amax and the codes equal ``cast_transpose`` of the formula's ``dy`` but where the
    kernel's fp32 sigmoid rounds ``dy`` to the neighbouring bf16 value (at most 0.1% of the codes, each one FP8
    step)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron_core.fp8 import cast_kernels as ck
    from megatron_core.fp8 import swiglu_grad_cast as sgc

    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, half in ((4096, 8192), (1000, 720), (37, 130)):
        y = (torch.randn(rows, 2 * half, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        g = (torch.randn(rows, half, device="cuda", generator=gen) * 1e-3).to(torch.bfloat16)
        assert sgc.swiglu_grad_cast_serves(g, y)
        want = sgc.swiglu_grad(g, y)
        amax = sgc.swiglu_grad_amax(g, y)
        assert amax.shape == () and torch.allclose(amax, want.abs().amax().float(), rtol=2 ** -7)
        scale = torch.finfo(dtype).max / amax
        codes, transposed = sgc.swiglu_grad_cast_transpose(g, y, scale, dtype)
        want_codes, want_transposed = ck.cast_transpose(want, scale, dtype)
        assert transposed.shape == want_transposed.shape
        differ = codes.view(torch.uint8) != want_codes.view(torch.uint8)
        assert differ.float().mean() < 1e-3, differ.float().mean()
        step = 2.0 ** -2 if dtype == torch.float8_e5m2 else 2.0 ** -3
        err = (codes.float() - want_codes.float()).abs()
        assert (err <= step * want_codes.float().abs() + 2.0 ** -16).all()
        assert torch.equal(transposed[:, :rows].view(torch.uint8), codes.t().contiguous().view(torch.uint8))
        assert not transposed[:, rows:].view(torch.uint8).any()


@pytest.mark.gpu
def test_gpu_compiled_fp8_gpt_trains_alike_with_and_without_the_fused_swiglu(monkeypatch):
    """A bf16 llama-like GPT with FP8 parameters, each layer compiled, 4 Adam steps: the fused route against the
    MLP's own SwiGLU (the same function; FP8 rounding of the output gradient apart): losses within 1%."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability >= 8.9)")
    from tests.cuda_process_group import in_fresh_process
    from tests.transformer.test_layer_cuda_graphs import _cuda_train

    fused = in_fresh_process(_cuda_train, "none", True, True)
    unfused = in_fresh_process(_train_without_fused_swiglu)
    assert torch.allclose(fused["losses"], unfused["losses"], rtol=1e-2), (fused["losses"], unfused["losses"])
    assert fused["losses"][-1] < fused["losses"][0]


def _train_without_fused_swiglu() -> dict:
    from tests.transformer.test_layer_cuda_graphs import _cuda_train

    fp8_param_linear.FUSED_SWIGLU_GRAD = False
    return _cuda_train("none", True, True)

