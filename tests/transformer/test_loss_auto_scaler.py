"""The loss auto-scalers (MoE aux loss, MTP loss, DSA indexer loss) share one rule: identity forward, and a backward
that gives the attached loss ``main_loss_backward_scale`` (default 1), each class with its own scale."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from megatron_core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler
from megatron_core.transformer.loss_auto_scaler import LossAutoScaler
from megatron_core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron_core.transformer.multi_token_prediction import MTPLossAutoScaler

SCALERS = [MoEAuxLossAutoScaler, MTPLossAutoScaler, DSAIndexerLossAutoScaler]
IDS = ["moe", "mtp", "dsa"]
LOSS_ARGUMENT = {MoEAuxLossAutoScaler: "aux_loss", MTPLossAutoScaler: "mtp_loss",
                 DSAIndexerLossAutoScaler: "indexer_loss"}  # Megatron-Core's names for the forward's loss


@pytest.fixture(autouse=True)
def _restore_scales():
    saved = {cls: cls.main_loss_backward_scale for cls in SCALERS}
    for cls in (MoEAuxLossAutoScaler, DSAIndexerLossAutoScaler):
        cls.main_loss_backward_scale = None
    MTPLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)
    yield
    for cls, scale in saved.items():
        cls.main_loss_backward_scale = scale


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, generator=gen, requires_grad=True), torch.randn(5, 4, generator=gen)


def _main_and_side(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An activation ``[5, 3]`` and a 0-dim side loss, both depending on ``w``."""
    return x @ w, (w.sin() ** 2).sum()


def _attached(cls, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    out, side = _main_and_side(w, x)
    return (cls.apply(out, side) ** 2).sum()


def _reference_grad(w: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """The gradient of ``main + scale * side`` on a fresh leaf with the same values."""
    w_ref = w.detach().clone().requires_grad_(True)
    out, side = _main_and_side(w_ref, x)
    ((out ** 2).sum() + scale * side).backward()
    return w_ref.grad


def _grad(fn, cls, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    w.grad = None
    fn(cls, w, x).backward()
    return w.grad.clone()


@pytest.mark.parametrize("cls", SCALERS, ids=IDS)
def test_forward_returns_the_output_unchanged(cls):
    w, x = _weights()
    out, side = _main_and_side(w, x)
    got = cls.apply(out, side)
    assert torch.equal(got, out)
    assert got.grad_fn is not None and type(got.grad_fn).__name__ == f"{cls.__name__}Backward"
    assert torch.equal(cls.apply(output=out, **{LOSS_ARGUMENT[cls]: side}), out)


@pytest.mark.parametrize("cls", SCALERS, ids=IDS)
def test_backward_scale_defaults_to_one(cls):
    w, x = _weights()
    torch.testing.assert_close(_grad(_attached, cls, w, x), _reference_grad(w, x, 1.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", SCALERS, ids=IDS)
def test_backward_uses_the_scale_set_by_set_loss_scale(cls):
    w, x = _weights()
    for scale in (0.25, 3.0):
        cls.set_loss_scale(torch.tensor(scale))
        want = _reference_grad(w, x, scale)
        torch.testing.assert_close(_grad(_attached, cls, w, x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", SCALERS, ids=IDS)
def test_one_element_scale_gives_a_zero_dim_loss_its_gradient(cls):
    w, x = _weights()
    cls.set_loss_scale(torch.tensor([0.5]))  # the schedules' scale has shape [1]
    torch.testing.assert_close(_grad(_attached, cls, w, x), _reference_grad(w, x, 0.5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", SCALERS, ids=IDS)
def test_direct_assignment_is_the_scale_the_backward_reads(cls):
    w, x = _weights()
    cls.main_loss_backward_scale = torch.tensor(4.0)
    torch.testing.assert_close(_grad(_attached, cls, w, x), _reference_grad(w, x, 4.0), rtol=1e-5, atol=1e-6)


def test_each_class_has_its_own_scale():
    w, x = _weights()
    for i, cls in enumerate(SCALERS):
        cls.set_loss_scale(torch.tensor(float(i + 2)))
    for i, cls in enumerate(SCALERS):
        assert cls.main_loss_backward_scale.item() == float(i + 2)
        want = _reference_grad(w, x, float(i + 2))
        torch.testing.assert_close(_grad(_attached, cls, w, x), want, rtol=1e-5, atol=1e-6)
    assert LossAutoScaler.main_loss_backward_scale is None


def test_a_new_subclass_gets_a_fresh_slot_and_its_own_default():
    class Plain(LossAutoScaler):
        pass

    class Halved(LossAutoScaler):
        main_loss_backward_scale = torch.tensor(0.5)

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(9.0))
    w, x = _weights()
    assert Plain.main_loss_backward_scale is None
    torch.testing.assert_close(_grad(_attached, Plain, w, x), _reference_grad(w, x, 1.0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_grad(_attached, Halved, w, x), _reference_grad(w, x, 0.5), rtol=1e-5, atol=1e-6)
    Plain.set_loss_scale(2.0)  # the base stores torch.as_tensor(scale)
    assert torch.equal(Plain.main_loss_backward_scale, torch.tensor(2.0))
    assert Halved.main_loss_backward_scale.item() == 0.5


def test_moe_set_loss_scale_stores_a_new_zero_dim_float32_tensor():
    given = torch.tensor([2.0], dtype=torch.float64)
    MoEAuxLossAutoScaler.set_loss_scale(given)
    stored = MoEAuxLossAutoScaler.main_loss_backward_scale
    assert stored.shape == () and stored.dtype == torch.float32 and stored.item() == 2.0
    given.fill_(5.0)
    assert stored.item() == 2.0  # a copy, not the caller's tensor


def test_mtp_scale_defaults_to_a_tensor_and_set_loss_scale_accepts_numbers():
    assert torch.equal(MTPLossAutoScaler.main_loss_backward_scale, torch.tensor(1.0))
    MTPLossAutoScaler.set_loss_scale(0.125)
    assert torch.equal(MTPLossAutoScaler.main_loss_backward_scale, torch.tensor(0.125))


def test_dsa_set_loss_scale_requires_a_tensor_and_copies_in_place_after_the_first():
    with pytest.raises(TypeError, match="torch.Tensor"):
        DSAIndexerLossAutoScaler.set_loss_scale(0.5)
    first = torch.tensor([2.0], requires_grad=True)
    DSAIndexerLossAutoScaler.set_loss_scale(first)
    stored = DSAIndexerLossAutoScaler.main_loss_backward_scale
    assert not stored.requires_grad and stored.data_ptr() == first.data_ptr()
    DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor([3.0]))
    assert DSAIndexerLossAutoScaler.main_loss_backward_scale is stored and stored.item() == 3.0


@pytest.mark.parametrize("cls", SCALERS, ids=IDS)
def test_compiled_backward_equals_eager_and_follows_each_new_scale(cls):
    w, x = _weights()
    torch._dynamo.reset()
    compiled = torch.compile(_attached, backend="aot_eager", fullgraph=True)
    try:
        got_default = _grad(compiled, cls, w, x)  # MoE and DSA: no scale yet (None)
        torch.testing.assert_close(got_default, _grad(_attached, cls, w, x), rtol=1e-5, atol=1e-6)
        cls.set_loss_scale(torch.tensor(2.0))
        compiled(cls, w, x)  # None -> tensor may recompile once; later scales must not
        with torch._dynamo.config.patch(error_on_recompile=True):
            for scale in (2.0, 7.0, 0.5):
                cls.set_loss_scale(torch.tensor(scale))
                for other in SCALERS:  # another class's scale must not invalidate this graph
                    if other is not cls:
                        other.set_loss_scale(torch.tensor(scale + 1.0))
                got = _grad(compiled, cls, w, x)
                torch.testing.assert_close(got, _grad(_attached, cls, w, x), rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(got, _reference_grad(w, x, scale), rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("cls", SCALERS, ids=IDS)
@pytest.mark.parametrize("shape", [(), (1,)], ids=["0dim", "1elem"])
@pytest.mark.parametrize("compile_it", [False, True], ids=["eager", "compiled"])
def test_cpu_scale_with_a_cuda_loss(cls, shape, compile_it):
    w_cpu, x_cpu = _weights()
    w = w_cpu.detach().cuda().requires_grad_(True)
    x = x_cpu.cuda()
    cls.main_loss_backward_scale = torch.full(shape, 3.0)  # a host tensor, whatever the class's setter does
    torch._dynamo.reset()
    fn = torch.compile(_attached, fullgraph=True) if compile_it else _attached
    try:
        got = _grad(fn, cls, w, x)
    finally:
        torch._dynamo.reset()
    assert got.device == w.device
    torch.testing.assert_close(got.cpu(), _reference_grad(w_cpu, x_cpu, 3.0), rtol=1e-5, atol=1e-5)
