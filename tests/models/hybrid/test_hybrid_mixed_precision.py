"""Mixed precision of the hybrid (Mamba) stack: a plain bf16 cast, ``Float16Module``, and the fp32 pieces.

Tolerances come from bf16's unit roundoff ``U = 2**-8`` (8 significand bits: every rounding moves a value by at
most ``U`` of itself). Megatron-Core 0.19 creates ``A_log`` and ``D`` in fp32 whatever ``params_dtype`` is, and
its ``Float16Module`` casts the whole module (those two included); the mixer then computes ``-exp(A_log)``,
``softplus(dt + dt_bias)``, ``D`` and the scan's sums in fp32, and the distributed optimizer keeps fp32 main
copies of every bf16 parameter. These tests check the same.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.ssm import mamba_mixer
from megatron_core.ssm.ssd_scan import ssd_chunk_scan
from megatron_core.transformer.module import Float16Module
from tests.models.mamba.mamba_test_utils import VOCAB, batch, config

PATTERN = "M*M-"
U = 2.0**-8  # bf16 unit roundoff
FP32_PIECES = ("mixer.A_log", "mixer.D")


def _model(**overrides) -> HybridModel:
    torch.manual_seed(0)
    return HybridModel(config(PATTERN, **overrides), hybrid_stack_spec, VOCAB, 128, hybrid_layer_pattern=PATTERN)


def _loss_and_grads(model: torch.nn.Module, loss_scale: float = 1.0) -> tuple[float, dict[str, torch.Tensor]]:
    ids, pos, labels = batch(seq=96)
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, None, labels=labels).float().mean()
    (loss * loss_scale).backward()
    return loss.item(), {n.removeprefix("module."): p.grad.float() / loss_scale for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype, unit, loss_scale", [(torch.bfloat16, U, 1.0), (torch.float16, 2.0**-11, 1024.0)],
                         ids=["bf16", "fp16"])
def test_plain_half_cast_runs_and_stays_close_to_fp32(dtype, unit, loss_scale):
    """``model.to(dtype)`` of an fp32-built model (as for ``GPTModel``) runs forward and backward.

    ``unit`` is the dtype's unit roundoff (fp16 has 11 significand bits). The loss is a mean over 192 tokens whose
    rounding errors are independent, so it moves far less than one rounding: it must stay within ``unit``
    (relative). Each gradient passes through about 24 roundings (4 layers, each rounding its input, weights and
    output, forward and backward); independent errors of at most ``unit`` add up to about ``sqrt(24) unit ~ 5
    unit`` in norm, and we allow twice that for the worst of 27 tensors. fp16 backpropagates a loss scaled by 1024,
    as fp16 training does (Megatron-Core's loss scaler): unscaled, many of these small gradients fall into fp16's
    subnormal range, where the relative precision is coarser than ``unit`` (1.2e-2 here against 4.9e-3).
    """
    fp32 = _model()
    want_loss, want_grads = _loss_and_grads(fp32)
    half = copy.deepcopy(fp32).to(dtype)
    assert {p.dtype for p in half.parameters()} == {dtype}
    loss, grads = _loss_and_grads(half, loss_scale)
    assert abs(loss - want_loss) <= unit * abs(want_loss)
    for name, grad in grads.items():
        rel = ((grad - want_grads[name]).norm() / want_grads[name].norm()).item()
        assert rel <= 10 * unit, f"{name}: relative error {rel:.5f} > {10 * unit:.5f}"


def test_float16_module_equals_the_plain_cast():
    """``Float16Module`` casts every parameter as Megatron-Core's does (``A_log`` and ``D`` too): the same numbers as
    the plain cast, its output in fp32."""
    fp32 = _model(bf16=True)
    plain_loss, plain_grads = _loss_and_grads(copy.deepcopy(fp32).to(torch.bfloat16))
    wrapped = Float16Module(fp32.config, copy.deepcopy(fp32))
    assert {p.dtype for p in wrapped.parameters()} == {torch.bfloat16}
    ids, pos, labels = batch(seq=96)
    assert wrapped(ids, pos, None, labels=labels).dtype == torch.float32
    loss, grads = _loss_and_grads(wrapped)
    assert loss == plain_loss
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=0, msg=name)


def test_bf16_params_dtype_keeps_a_log_and_d_in_fp32():
    """Built with ``params_dtype=bf16`` (no wrapper): ``A_log`` and ``D`` are fp32, every other parameter bf16, as
    Megatron-Core creates them; the mixed module runs and stays within the plain cast's bound of fp32."""
    model = _model(bf16=True, params_dtype=torch.bfloat16)
    for name, param in model.named_parameters():
        want = torch.float32 if name.endswith(FP32_PIECES) else torch.bfloat16
        assert param.dtype == want, f"{name}: {param.dtype}"
    loss, _ = _loss_and_grads(model)
    reference = _model()
    with torch.no_grad():  # the same values in fp32 (bf16-rounded where the bf16 model rounded them)
        for param, source in zip(reference.parameters(), model.parameters(), strict=True):
            param.copy_(source.float())
    want_loss, _ = _loss_and_grads(reference)
    assert abs(loss - want_loss) <= U * abs(want_loss)


def test_mixer_runs_its_scan_inputs_in_fp32(monkeypatch):
    """Under a bf16 cast the mixer hands the scan ``dt`` (after the bias and softplus) and ``A`` in fp32 (the scan
    upcasts ``D`` itself: see the next test)."""
    seen = []

    def spy(x, dt, A, B, C, chunk_size, D=None, **kwargs):
        seen.append((x.dtype, dt.dtype, A.dtype))
        return ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D, **kwargs)

    monkeypatch.setattr(mamba_mixer, "ssd_chunk_scan", spy)
    model = _model().to(torch.bfloat16)
    ids, pos, labels = batch(seq=24)
    with torch.no_grad():
        model(ids, pos, None, labels=labels)
    assert seen == [(torch.bfloat16, torch.float32, torch.float32)] * 2


@pytest.mark.parametrize("chunk_size", [8, 5])
def test_scan_accumulates_in_fp32(chunk_size):
    """The scan of bf16 inputs equals the fp32 scan of the same (bf16-valued) inputs rounded once at the end: every
    sum inside runs in fp32, only the output is rounded to bf16."""
    gen = torch.Generator().manual_seed(3)
    b, length, h, p, g, n = 2, 21, 4, 8, 2, 8
    x = torch.randn(b, length, h, p, generator=gen).bfloat16()
    dt = torch.rand(b, length, h, generator=gen) * 0.1
    A = -torch.rand(h, generator=gen)
    B = torch.randn(b, length, g, n, generator=gen).bfloat16()
    C = torch.randn(b, length, g, n, generator=gen).bfloat16()
    D = torch.rand(h, generator=gen).bfloat16()
    got = ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D)
    want = ssd_chunk_scan(x.float(), dt, A, B.float(), C.float(), chunk_size, D=D.float()).bfloat16()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
