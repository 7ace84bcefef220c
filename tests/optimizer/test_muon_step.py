"""One-process Muon, adaptive Muon and Lion steps against hand-written references (float64 reference, fp32 run).

Muon, per step: ``p <- p (1 - lr wd)``, ``m <- beta m + (1 - beta) g``, direction ``m`` (Nesterov: ``(1 - beta) g +
beta m``), ``p <- p - lr * scale * NS(direction)``; the Newton-Schulz reference is written out here.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.optimizer.emerging_optimizers import TensorParallelAdaptiveMuon, TensorParallelMuon
from megatron_core.optimizer.lion import Lion
from megatron_core.optimizer.newton_schulz import COEFFICIENT_SETS

LR, WD, BETA = 0.05, 0.1, 0.9


def _ns(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Hand-written quintic Newton-Schulz in float64."""
    x = x.double()
    flip = x.shape[0] > x.shape[1]
    y = (x.T if flip else x) / x.norm()
    for i in range(steps):
        a, b, c = COEFFICIENT_SETS["quintic"][i % 5]
        gram = y @ y.T
        y = a * y + b * gram @ y + c * gram @ gram @ y
    return y.T if flip else y


def _scale(shape: tuple[int, int], mode: str) -> float:
    m, n = shape
    return {"spectral": max(m, n) ** 0.5, "unit_rms_norm": (m / n) ** 0.5, "shape_scaling": max(1.0, m / n) ** 0.5}[mode]


def _param_and_grads(shape=(6, 10), steps=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(*shape, generator=gen))
    grads = [torch.randn(*shape, generator=gen) for _ in range(steps)]
    return p, grads


def _run(opt: torch.optim.Optimizer, p: torch.nn.Parameter, grads: list[torch.Tensor]) -> None:
    for g in grads:
        p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("scale_mode", ["spectral", "unit_rms_norm", "shape_scaling"])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("decoupled", [True, False])
def test_muon_steps_match_reference(scale_mode, nesterov, decoupled):
    p, grads = _param_and_grads(shape=(10, 6) if scale_mode == "shape_scaling" else (6, 10))
    ref = p.detach().double().clone()
    opt = TensorParallelMuon([p], lr=LR, momentum=BETA, nesterov=nesterov, weight_decay=WD,
                             use_decoupled_weight_decay=decoupled, fp32_matmul_prec="highest",
                             scale_mode=scale_mode, extra_scale_factor=0.7)
    _run(opt, p, grads)
    m = torch.zeros_like(ref)
    for g in grads:
        g = g.double()
        if decoupled:
            ref = ref * (1 - LR * WD)
        else:
            g = g + WD * ref
        m = BETA * m + (1 - BETA) * g
        direction = (1 - BETA) * g + BETA * m if nesterov else m
        ref = ref - LR * 0.7 * _scale(tuple(ref.shape), scale_mode) * _ns(direction)
    torch.testing.assert_close(p.detach().double(), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), m, rtol=0, atol=1e-6)


def test_qkv_weight_is_orthogonalised_per_query_key_value_section():
    shapes, groups, hidden = [4, 2, 2], 2, 8  # two query groups of [q 4 rows, k 2, v 2]
    p, grads = _param_and_grads(shape=(groups * sum(shapes), hidden), steps=1, seed=1)
    p.is_qkv, p.qkv_split_shapes = True, shapes
    ref = p.detach().double().clone()
    opt = TensorParallelMuon([p], lr=LR, momentum=BETA, nesterov=False, weight_decay=0.0, split_qkv=True,
                             fp32_matmul_prec="highest")
    _run(opt, p, grads)
    direction = ((1 - BETA) * grads[0].double()).view(groups, sum(shapes), hidden)
    pieces = []
    for part in torch.split(direction, shapes, dim=1):
        matrix = part.reshape(-1, hidden)
        pieces.append((_scale(tuple(matrix.shape), "spectral") * _ns(matrix)).view(groups, -1, hidden))
    ref = ref - LR * torch.cat(pieces, dim=1).view_as(ref)
    torch.testing.assert_close(p.detach().double(), ref, rtol=0, atol=1e-5)

    whole, _ = _param_and_grads(shape=p.shape, steps=1, seed=1)  # without the split: one matrix, another update
    plain = TensorParallelMuon([whole], lr=LR, momentum=BETA, nesterov=False, weight_decay=0.0,
                               fp32_matmul_prec="highest")
    _run(plain, whole, grads)
    assert (whole.detach().double() - ref).abs().max() > 1e-3


def test_qkv_split_shape_mismatch_is_refused():
    p, grads = _param_and_grads(shape=(10, 8), steps=1)
    p.is_qkv, p.qkv_split_shapes = True, [4, 2, 2]
    opt = TensorParallelMuon([p], split_qkv=True)
    with pytest.raises(ValueError, match=r"shape \(10, 8\).*\[4, 2, 2\]"):
        _run(opt, p, grads)


@pytest.mark.parametrize("method", ["adamuon", "normuon"])
def test_adaptive_muon_matches_reference(method):
    p, grads = _param_and_grads(shape=(6, 10))
    ref = p.detach().double().clone()
    beta2, eps = 0.95, 1e-8
    opt = TensorParallelAdaptiveMuon([p], lr=LR, momentum=BETA, nesterov=False, weight_decay=WD,
                                     fp32_matmul_prec="highest", moment2_method=method, beta2=beta2, eps=eps)
    _run(opt, p, grads)
    m = torch.zeros_like(ref)
    v = torch.zeros_like(ref) if method == "adamuon" else torch.zeros(1, 10, dtype=torch.float64)
    for g in grads:
        ref = ref * (1 - LR * WD)
        m = BETA * m + (1 - BETA) * g.double()
        orth = _ns(m)
        if method == "adamuon":
            v = beta2 * v + (1 - beta2) * orth**2
            update = orth / (v.sqrt() + eps)
        else:  # fewer rows than columns: one second moment per column (the mean over the rows)
            v = beta2 * v + (1 - beta2) * (orth**2).mean(dim=0, keepdim=True)
            update = orth / v.sqrt()
            update = update * orth.norm() / update.norm()
        ref = ref - LR * _scale((6, 10), "spectral") * update
    torch.testing.assert_close(p.detach().double(), ref, rtol=1e-5, atol=1e-5)
    assert opt.state[p]["moment2_buffer"].shape == v.shape


def test_lion_matches_reference():
    p, grads = _param_and_grads(shape=(5,), steps=3)
    ref = p.detach().double().clone()
    opt = Lion([p], lr=LR, betas=(0.9, 0.99), weight_decay=WD)
    _run(opt, p, grads)
    m = torch.zeros_like(ref)
    for g in grads:
        g = g.double()
        ref = ref * (1 - LR * WD) - LR * torch.sign(0.9 * m + 0.1 * g)
        m = 0.99 * m + 0.01 * g
    torch.testing.assert_close(p.detach().double(), ref, rtol=0, atol=1e-6)
    assert opt.state[p]["step"] == 3


def test_constructor_checks_name_the_argument():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"num_ns_steps \(0\)"):
        TensorParallelMuon([p], num_ns_steps=0)
    with pytest.raises(ValueError, match=r"tp_mode \('sharded'\) must be one of"):
        TensorParallelMuon([p], tp_mode="sharded")
    with pytest.raises(ValueError, match=r"moment2_method \('namo'\)"):
        TensorParallelAdaptiveMuon([p], moment2_method="namo")
    with pytest.raises(ValueError, match=r"Lion: betas\[1\] \(1.0\)"):
        Lion([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="2-D weights only"):
        q = torch.nn.Parameter(torch.zeros(3))
        q.grad = torch.ones(3)
        TensorParallelMuon([q]).step()
