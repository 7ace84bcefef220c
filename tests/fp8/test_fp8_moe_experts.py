"""FP8 MoE experts: the grouped GEMM's scaling, the converted MoE GPT on CPU (emulated), EP=2, and the GPU kernel.

The emulated grouped GEMM (``fp8_grouped_gemm`` on CPU) rounds each operand through e4m3 with one
power-of-two scale per row / column as the module docstring tables; its properties are checked directly
(exact on e4m3-representable operands, scale-equivariant per row, errors of e4m3's size otherwise).
Under expert parallelism every quantization scale is taken over a row of ``x`` or ``dy`` (forward and
dgrad) or over one expert's rows (wgrad), never across ranks; with the same micro-batch on both ranks an
expert sees each of its rows twice, which leaves every scale as in one process: loss and dense gradients
equal one process, expert gradients are twice its (the tolerance is fp32 summation order, 1e-5, unless a
value sits exactly on an e4m3 rounding boundary).
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.fp8 import (
    Float8ColumnParallelGroupedLinear,
    Float8RowParallelGroupedLinear,
    convert_to_float8,
    fp8_grouped_gemm,
)
from megatron_core.fp8.grouped_gemm import quantize_dequantize_e4m3
from tests.dist_harness import run_on_ranks
from tests.transformer.moe.moe_parallel_utils import batches, build, global_tensors, load_globals

pytest.importorskip("torchao.float8")

FP8 = dict(fp8="e4m3", fp8_recipe="tensorwise")


def _plain_grouped(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    pieces = torch.split(x, counts)
    return torch.cat([p @ weight[e].t() for e, p in enumerate(pieces)])


def _representable(*shape: int, seed: int) -> torch.Tensor:
    """Small integers times powers of two: exact in e4m3 (3 mantissa bits) whatever power-of-two scale is used."""
    gen = torch.Generator().manual_seed(seed)
    mantissa = torch.randint(-8, 9, shape, generator=gen).float()
    exponent = torch.randint(-3, 3, shape, generator=gen).float()
    return mantissa * torch.exp2(exponent)


def test_grouped_gemm_is_exact_on_e4m3_representable_operands():
    counts = [5, 0, 11]
    x = _representable(16, 32, seed=0).requires_grad_()
    w = _representable(3, 48, 32, seed=1).requires_grad_()
    grad = _representable(16, 48, seed=2)
    out = fp8_grouped_gemm(x, w, counts=counts)
    out.backward(grad)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = _plain_grouped(x_ref, w_ref, counts)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=0, atol=0)
    assert torch.count_nonzero(w.grad[1]) == 0  # an expert without rows gets a zero gradient


def test_scales_are_per_row_powers_of_two():
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    scaled = x.clone()
    scaled[3] *= 2.0 ** 5  # one row 32x larger: its own scale absorbs it, the other rows are untouched
    q, q_scaled = quantize_dequantize_e4m3(x, -1), quantize_dequantize_e4m3(scaled, -1)
    torch.testing.assert_close(q_scaled[3], q[3] * 2.0 ** 5, rtol=0, atol=0)
    torch.testing.assert_close(q_scaled[torch.arange(8) != 3], q[torch.arange(8) != 3], rtol=0, atol=0)
    relative = ((q - x).abs() / x.abs().amax(-1, keepdim=True)).max()
    assert 0 < relative <= 2.0 ** -4  # e4m3 rounds to 3 mantissa bits


def test_grouped_gemm_tracks_fp32_within_e4m3_error():
    gen = torch.Generator().manual_seed(0)
    counts = [40, 24, 0, 64]
    x = torch.randn(128, 64, generator=gen, requires_grad=True)
    w = (torch.randn(4, 96, 64, generator=gen) * 0.1).requires_grad_()
    grad = torch.randn(128, 96, generator=gen)
    out = fp8_grouped_gemm(x, w, counts=counts)
    out.backward(grad)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = _plain_grouped(x_ref, w_ref, counts)
    ref.backward(grad)
    for got, want in ((out, ref), (x.grad, x_ref.grad), (w.grad, w_ref.grad)):
        error = ((got - want).norm() / want.norm()).item()
        assert 1e-4 < error < 0.06, error  # rounded (not fp32), but only by e4m3's few percent


def test_bad_operands_are_refused():
    with pytest.raises(ValueError, match="counts sum to 5"):
        fp8_grouped_gemm(torch.zeros(4, 16), torch.zeros(2, 16, 16), counts=[2, 3])
    with pytest.raises(ValueError, match=r"\[N, in\] and \[E, out, in\]"):
        fp8_grouped_gemm(torch.zeros(4, 16), torch.zeros(2, 16, 32), counts=[2, 2])


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids, pos, labels = batches(1)[0]
    loss = model(ids, pos, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {k: v.grad.detach().clone() for k, v in model.named_parameters()}


def test_converted_moe_model_runs_its_experts_in_fp8():
    torch.manual_seed(0)
    model = build("mixtral", moe_grouped_gemm=True, **FP8)
    reference = build("mixtral", moe_grouped_gemm=True)
    reference.load_state_dict(model.state_dict())
    names = convert_to_float8(model, emulate=True)
    experts = [n for n in names if ".experts." in n]
    assert len(experts) == 4  # fc1 and fc2 of two layers
    assert isinstance(model.decoder.layers[0].mlp.experts.linear_fc1, Float8ColumnParallelGroupedLinear)
    assert isinstance(model.decoder.layers[0].mlp.experts.linear_fc2, Float8RowParallelGroupedLinear)
    loss, grads = _loss_and_grads(model)
    ref_loss, ref_grads = _loss_and_grads(reference)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    key = "decoder.layers.0.mlp.experts.linear_fc1.weight"
    assert not torch.equal(grads[key], ref_grads[key])  # the experts' GEMMs really are rounded
    for name, got in grads.items():
        want = ref_grads[name]
        assert (got - want).norm() <= 0.15 * want.norm() + 1e-6, name
    assert model.state_dict().keys() == reference.state_dict().keys()  # no FP8 state in the checkpoint


def _ep2_fp8() -> list[str]:
    overrides = dict(moe_grouped_gemm=True, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, **FP8)
    torch.manual_seed(1234)
    reference = build("mixtral", **overrides)
    before = global_tensors(reference)
    convert_to_float8(reference, emulate=True)
    ref_loss, ref_grads = _loss_and_grads(reference)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build("mixtral", expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall", **overrides)
        load_globals(model, before)
        convert_to_float8(model, emulate=True)
        loss, grads = _loss_and_grads(model)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        rank = parallel_state.get_expert_model_parallel_rank()
        for name, got in grads.items():
            want = ref_grads[name]
            if ".experts." in name:  # local experts [2 * rank, 2 * rank + 2); each saw both ranks' identical rows
                want = 2.0 * want[2 * rank: 2 * rank + 2]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, k=name: f"{k}: {m}")
        return sorted(grads)
    finally:
        parallel_state.destroy_model_parallel()


def test_expert_parallel_fp8_matches_one_process():
    checked = run_on_ranks(2, _ep2_fp8)
    assert all(any(".experts." in k for k in keys) and len(keys) > 10 for keys in checked)


@pytest.mark.gpu
def test_fp8_grouped_gemm_kernel_matches_its_emulation():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs Hopper FP8 grouped GEMMs")
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = [48, 0, 144, 64]
    x = torch.randn(256, 512, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(4, 768, 512, device="cuda", generator=gen) * 0.05).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(256, 768, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = fp8_grouped_gemm(x, w, counts=counts)
    out.backward(grad)
    x_em, w_em = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    emulated = fp8_grouped_gemm(x_em, w_em, counts=counts, emulate=True)
    emulated.backward(grad)
    for got, want in ((out, emulated), (x.grad, x_em.grad), (w.grad, w_em.grad)):
        error = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert error < 1e-2, error  # same quantization; bf16 output rounding and accumulation order differ
