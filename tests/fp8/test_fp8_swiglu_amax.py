"""SwiGLU's output with its amax in one pass (``fp8.swiglu_amax``), handed from an FP8 ``linear_fc1`` to ``linear_fc2``.

CPU: the PyTorch path equals ``swiglu`` and its amax; an FP8-parameter GPT's MLPs hand the amax to ``linear_fc2``,
whose input scale is then the one it computes itself (same logits bit for bit with and without the handover).
Triton's interpreter and the GPU: the kernel's output and amax against the PyTorch formula; compiled code runs
the kernel, eager code the PyTorch ops (whose rounding it keeps).
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.fp8 import convert_to_float8
from megatron_core.fp8.layers import Float8RowParallelLinear
from megatron_core.fp8.swiglu_amax import swiglu_with_amax
from megatron_core.fp8.swiglu_grad_cast import swiglu
from tests.models.gpt_test_utils import batch, build, llama_like
from tests.triton_interpreter import needs_triton, run_in_triton_interpreter


def test_cpu_path_is_swiglu_and_its_amax():
    y = torch.randn(7, 24) * 3
    h, amax = swiglu_with_amax(y)
    assert torch.equal(h, swiglu(y)) and amax.shape == () and amax.dtype == torch.float32
    assert torch.equal(amax, h.abs().amax())


def _logits(monkeypatch, handover: bool) -> tuple[torch.Tensor, list]:
    torch.manual_seed(0)
    model = build(llama_like(fp8="e4m3", fp8_recipe="tensorwise"), fp8_param=True)
    convert_to_float8(model, emulate=True)
    amaxes = []
    original = Float8RowParallelLinear.forward

    def recording(self, input_, input_amax=None):
        amaxes.append(input_amax)
        return original(self, input_, input_amax if handover else None)

    monkeypatch.setattr(Float8RowParallelLinear, "forward", recording)
    ids, pos, _ = batch(3)
    with torch.no_grad():
        return model(ids, pos, None), amaxes


def test_fp8_fc2_takes_the_amax_made_with_the_activation(monkeypatch):
    with_handover, amaxes = _logits(monkeypatch, True)
    without, _ = _logits(monkeypatch, False)
    handed = [a for a in amaxes if a is not None]
    assert len(handed) == 2 and all(a.shape == () for a in handed)  # both layers' linear_fc2; not linear_proj
    assert torch.equal(with_handover, without)


_INTERPRETED = """
import torch
from megatron_core.fp8 import swiglu_amax as sa
from megatron_core.fp8.swiglu_grad_cast import swiglu
sa._CONFIGS = ((16, 32, 4),)  # one config: the autotuner's timing needs a GPU; small tiles cross the edges
gen = torch.Generator().manual_seed(0)
for rows, half in ((37, 48), (64, 96)):
    y = (torch.randn(rows, 2 * half, generator=gen) * 2).to(torch.bfloat16)
    h, amax = sa._swiglu_amax(y)
    want = swiglu(y.float())
    assert h.dtype == torch.bfloat16 and h.shape == (rows, half)
    assert torch.allclose(h.float(), want, rtol=2 ** -7, atol=1e-6), (h.float() - want).abs().max()
    assert amax.shape == () and torch.equal(amax, h.float().abs().amax())
"""


@needs_triton
def test_interpreted_kernel_gives_swiglu_and_its_amax():
    run_in_triton_interpreter(_INTERPRETED)


@pytest.mark.gpu
def test_gpu_kernel_equals_the_formula_and_serves_compiled_code():
    """bf16 inputs: ``h`` within one bf16 rounding of the fp32 formula, the amax exactly ``h``'s; a compiled
    caller runs the kernel (the op in its graph), an eager one the PyTorch ops."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, half in ((4096, 8192), (1000, 720), (37, 130)):
        y = (torch.randn(rows, 2 * half, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        h, amax = torch.ops.megatron_core.fp8_swiglu_amax(y)
        want = swiglu(y.float())
        assert torch.allclose(h.float(), want, rtol=2 ** -7, atol=1e-6), (h.float() - want).abs().max()
        assert amax.shape == () and torch.equal(amax, h.float().abs().amax())
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    compiled_h, compiled_amax = torch.compile(swiglu_with_amax, backend=backend, fullgraph=True)(y)
    assert any("fp8_swiglu_amax" in g for g in graphs), graphs
    assert torch.equal(compiled_h, h) and torch.equal(compiled_amax, amax)
    eager_h, eager_amax = swiglu_with_amax(y)
    assert torch.equal(eager_h, swiglu(y)) and torch.equal(eager_amax, eager_h.float().abs().amax())
