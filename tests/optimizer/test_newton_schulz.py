"""Newton-Schulz orthogonalisation against the SVD polar factor ``U V^T`` (float64) and a hand-written step.

Each step maps every singular value ``s`` of the Frobenius-normalised matrix to ``a s + b s^3 + c s^5`` and keeps the
singular vectors, so the result is exactly ``U diag(p(s / ||X||_F)) V^T`` with ``p`` the composed scalar polynomial;
that is checked to 1e-12. The tuned ``quintic`` schedule does not converge to 1: over normalised singular values in
``[0.01, 1]`` its 5-step polynomial stays in ``[0.9778, 1.0318]``, so ``||NS(X) - U V^T||_2 <= 0.0318`` for such
matrices (and no better is promised); the 8-step ``polar_express`` schedule reaches 1 within 1e-3 there.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_core.optimizer.emerging_optimizers import (
    get_supported_coefficient_types,
    validate_coefficient_type,
)
from megatron_core.optimizer.newton_schulz import (
    coefficient_schedule,
    get_muon_scale_factor,
    newton_schulz,
    newton_schulz_step,
)


def _matrix(m: int, n: int, singular: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(X, U, V)`` with ``X = U diag(singular) V^T`` in float64."""
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    return u @ torch.diag(singular.double()) @ v.T, u, v


def _composed(coefficient_type: str, steps: int, s: torch.Tensor) -> torch.Tensor:
    for a, b, c in coefficient_schedule(coefficient_type, steps):
        s = a * s + b * s**3 + c * s**5
    return s


@pytest.mark.parametrize("shape", [(12, 20), (20, 12), (16, 16)])
@pytest.mark.parametrize("coefficient_type,steps", [("quintic", 5), ("simple", 3), ("polar_express", 9)])
def test_result_is_the_composed_polynomial_of_the_singular_values(shape, coefficient_type, steps):
    k = min(shape)
    singular = torch.logspace(-2, 0, k, dtype=torch.float64)
    x, u, v = _matrix(*shape, singular)
    expected = u @ torch.diag(_composed(coefficient_type, steps, singular / singular.norm())) @ v.T
    got = newton_schulz(x, steps, coefficient_type, fp32_matmul_prec="highest")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_quintic_approximates_the_polar_factor_within_its_band():
    singular = torch.linspace(0.05, 1.0, 24, dtype=torch.float64) * 7.0  # any scale: the iteration normalises
    x, u, v = _matrix(24, 40, singular, seed=1)
    polar = u @ v.T
    svd_u, _, svd_vh = torch.linalg.svd(x, full_matrices=False)
    torch.testing.assert_close(svd_u @ svd_vh, polar, rtol=0, atol=1e-12)  # the SVD's polar factor is U V^T
    normalised = singular / singular.norm()
    band = (_composed("quintic", 5, normalised) - 1).abs().max().item()
    assert normalised.min() >= 0.01  # inside the range the band was measured on
    assert band <= 0.0318 + 1e-4
    error = torch.linalg.matrix_norm(newton_schulz(x, 5, "quintic", fp32_matmul_prec="highest") - polar, ord=2)
    assert error.item() == pytest.approx(band, abs=1e-10)  # the spectral error is exactly the band's deviation
    assert error.item() > 1e-3  # quintic does not converge to U V^T: the tolerance is the band, not rounding
    pe = newton_schulz(x, 8, "polar_express", fp32_matmul_prec="highest")
    assert torch.linalg.matrix_norm(pe - polar, ord=2).item() < 1e-3


def test_fp32_and_bf16_precisions_stay_close_to_the_float64_result():
    singular = torch.logspace(-1, 0, 16, dtype=torch.float64)
    x, _, _ = _matrix(16, 24, singular, seed=2)
    exact = newton_schulz(x, 5, "quintic")
    fp32 = newton_schulz(x.float(), 5, "quintic", fp32_matmul_prec="highest")
    bf16 = newton_schulz(x.float(), 5, "quintic", fp32_matmul_prec="medium")
    assert fp32.dtype == bf16.dtype == torch.float32
    torch.testing.assert_close(fp32.double(), exact, rtol=0, atol=1e-5)
    assert (bf16.double() - exact).abs().max() < 0.1  # bf16 iterations: ~3 significant digits
    assert not torch.equal(bf16, fp32)


def test_one_step_matches_the_hand_formula():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    a, b, c = 3.0, -4.0, 2.0
    gram = x @ x.T
    expected = a * x + b * gram @ x + c * gram @ gram @ x
    torch.testing.assert_close(newton_schulz_step(x, a, b, c), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(newton_schulz_step(x, a, b, 0.0), a * x + b * gram @ x, rtol=1e-12, atol=1e-12)


def test_full_iteration_matches_hand_written_reference():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(10, 7, generator=gen, dtype=torch.float64)
    ref = x.T / x.norm()  # taller than wide: iterate on the transpose
    for a, b, c in coefficient_schedule("quintic", 6):
        gram = ref @ ref.T
        ref = a * ref + (b * gram + c * gram @ gram) @ ref
    torch.testing.assert_close(newton_schulz(x, 6, "quintic"), ref.T, rtol=1e-12, atol=1e-12)


def test_schedules_cycle_or_repeat_their_last_step():
    quintic = coefficient_schedule("quintic", 7)
    assert quintic[5:] == quintic[:2]  # starts over
    polar = coefficient_schedule("polar_express", 10)
    assert polar[8] == polar[9] == polar[7]  # keeps the last
    with pytest.raises(ValueError, match="cubic5.*must be 5"):
        coefficient_schedule("cubic5", 4)


def test_scale_modes():
    assert get_muon_scale_factor(64, 16, "spectral") == 8.0
    assert get_muon_scale_factor(16, 64, "unit_rms_norm") == 0.5
    assert get_muon_scale_factor(16, 64, "shape_scaling") == 1.0
    assert get_muon_scale_factor(64, 16, "shape_scaling") == 2.0
    with pytest.raises(ValueError, match="scale_mode"):
        get_muon_scale_factor(4, 4, "bogus")


def test_coefficient_types_and_their_validation():
    supported = get_supported_coefficient_types()
    assert {"simple", "quintic", "polar_express"} <= set(supported)
    for name in supported:
        validate_coefficient_type(name)
    with pytest.raises(ValueError, match=r"muon_coefficient_type \('custom'\) must be one of .*quintic"):
        validate_coefficient_type("custom")
    assert math.isfinite(newton_schulz(torch.zeros(3, 4), 2).sum().item())  # a zero matrix stays zero, no nan
