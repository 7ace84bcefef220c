"""``HybridDeviceOptimizer`` (``optimizer/cpu_offloading``) against plain torch optimizers on identical weights.

On the CPU the CPU plays the device, so offloaded parameters still get separate host copies updated by the CPU
optimizer: for offload fractions 0, 0.5 and 1 (overlap on and off) several steps equal one AdamW / SGD over all
parameters, bf16 parameters updated in fp32 equal an fp32-master reference, a ``state_dict`` saved mid-run
resumes exactly, an LR schedule reaches both sub-optimizers, and bad settings raise. One GPU test runs CUDA
parameters with the copies overlapped on side streams.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from megatron_core.optimizer.cpu_offloading import HybridDeviceOptimizer

HPARAMS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}),
    "sgd": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9}),
}


class _Net(nn.Module):
    """A small MLP; ``unused`` comes first (so it is offloaded first) and never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(3, 3)
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _nets(dtype: torch.dtype = torch.float32, device: str = "cpu", count: int = 2) -> list[_Net]:
    torch.manual_seed(0)
    first = _Net().to(device=device, dtype=dtype)
    others = [_Net().to(device=device, dtype=dtype) for _ in range(count - 1)]
    for net in others:
        net.load_state_dict(first.state_dict())
    return [first, *others]


def _groups(net: _Net) -> list[dict]:
    """Two groups with different weight decay (decay on matrices only)."""
    params = list(net.parameters())
    return [{"params": [p for p in params if p.dim() == 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0}]


def _batch(step: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 + step)).to(device=device, dtype=dtype)


def _backward(net: _Net, step: int) -> None:
    p = next(net.parameters())
    net(_batch(step, p.device.type, p.dtype)).square().mean().backward()


def _hdo(net: _Net, name: str, fraction: float, **kwargs) -> HybridDeviceOptimizer:
    cls, hparams = HPARAMS[name]
    return HybridDeviceOptimizer(_groups(net), offload_fraction=fraction, cpu_optimizer_cls=cls,
                                 gpu_optimizer_cls=cls, **{**hparams, **kwargs})


def _train(net: _Net, optimizer: torch.optim.Optimizer, steps: range, scheduler=None) -> None:
    for step in steps:
        optimizer.zero_grad()
        _backward(net, step)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def _assert_same_params(net: _Net, ref: _Net, atol: float = 0.0) -> None:
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0.0 if atol == 0.0 else 1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_steps_equal_the_plain_optimizer(name, fraction, overlap):
    net, ref = _nets()
    hdo = _hdo(net, name, fraction, overlap_cpu_optimizer_d2h_h2d=overlap)
    cls, hparams = HPARAMS[name]
    _train(net, hdo, range(4))
    _train(ref, cls(_groups(ref), **hparams), range(4))
    _assert_same_params(net, ref)

    total = sum(p.numel() for p in net.parameters())
    offloaded = sum(p.numel() for p in hdo.gpu_params_map_cpu_copy)
    assert fraction * total <= offloaded < fraction * total + max(p.numel() for p in net.parameters()) + 1
    assert (hdo.gpu_optimizer is None) == (fraction == 1.0)
    assert len(hdo.cpu_optimizers) == (len(hdo.gpu_params_map_cpu_copy) if overlap else int(fraction > 0))
    for orig, copy in hdo.gpu_params_map_cpu_copy.items():
        assert copy is not orig and torch.equal(copy, orig.detach())
    assert net.unused.weight in hdo.gpu_params_map_cpu_copy if fraction > 0 else True
    assert all(v.is_cpu for s in hdo.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    if name == "adamw":  # every parameter that had a gradient has state, under its original parameter
        trained = [p for p in net.parameters() if p.grad is not None]
        assert set(hdo.state) == set(trained) and all("exp_avg" in hdo.state[p] for p in trained)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_bf16_params_updated_in_fp32_equal_an_fp32_master_reference(fraction):
    net, ref = _nets(torch.bfloat16)
    hdo = _hdo(net, "adamw", fraction, param_update_in_fp32=True)
    masters = [p.detach().float() for p in ref.parameters()]
    groups = _groups(ref)
    index = {p: i for i, p in enumerate(ref.parameters())}
    master_opt = torch.optim.AdamW([{**g, "params": [masters[index[p]] for p in g["params"]]} for g in groups],
                                   **HPARAMS["adamw"][1])
    for step in range(4):
        hdo.zero_grad()
        _backward(net, step)
        hdo.step()
        ref.zero_grad()
        _backward(ref, step)
        for p, master in zip(ref.parameters(), masters):
            master.grad = None if p.grad is None else p.grad.float()
        master_opt.step()
        with torch.no_grad():
            for p, master in zip(ref.parameters(), masters):
                p.copy_(master)
    _assert_same_params(net, ref)
    for p, master in zip(net.parameters(), masters):
        if p.grad is not None:
            assert hdo.state[p]["master_param"].dtype == torch.float32
            torch.testing.assert_close(hdo.state[p]["master_param"], master, rtol=0.0, atol=1e-6)
    assert set(hdo.param_to_fp32_param) == set(net.parameters())


def _save(optimizer: torch.optim.Optimizer) -> dict:
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # the optimizer classes are saved by name: no unpickling


@pytest.mark.parametrize(("dtype", "fraction", "overlap_after"), [
    (torch.float32, 0.0, True), (torch.float32, 0.5, True), (torch.float32, 1.0, False),
    (torch.bfloat16, 0.5, True), (torch.bfloat16, 1.0, True)])
def test_state_dict_round_trip_resumes_exactly(dtype, fraction, overlap_after):
    fp32_update = dtype != torch.float32
    net, ref, resumed = _nets(dtype, count=3)
    uninterrupted = _hdo(ref, "adamw", fraction, param_update_in_fp32=fp32_update)
    _train(ref, uninterrupted, range(4))

    first = _hdo(net, "adamw", fraction, param_update_in_fp32=fp32_update)
    _train(net, first, range(2))
    saved, weights = _save(first), net.state_dict()
    if fp32_update:
        assert all(s["master_param"].dtype == torch.float32 for s in saved["state"].values())
    resumed.load_state_dict(weights)
    fresh = _hdo(resumed, "adamw", fraction, param_update_in_fp32=fp32_update,
                 overlap_cpu_optimizer_d2h_h2d=overlap_after)
    fresh.load_state_dict(saved)
    assert set(fresh.state) <= set(resumed.parameters())
    _train(resumed, fresh, range(2, 4))
    _assert_same_params(resumed, ref)
    for p, q in zip(resumed.parameters(), ref.parameters()):
        if p in fresh.state:
            for key, value in fresh.state[p].items():
                torch.testing.assert_close(value, uninterrupted.state[q][key], rtol=0.0, atol=0.0)


def test_lr_schedule_reaches_both_sub_optimizers():
    net, ref = _nets()
    hdo = _hdo(net, "adamw", 0.5)
    plain = torch.optim.AdamW(_groups(ref), **HPARAMS["adamw"][1])
    decay = lambda step: 0.5 ** step  # noqa: E731
    _train(net, hdo, range(4), torch.optim.lr_scheduler.LambdaLR(hdo, decay))
    _train(ref, plain, range(4), torch.optim.lr_scheduler.LambdaLR(plain, decay))
    _assert_same_params(net, ref)
    assert hdo.cpu_optimizers and hdo.gpu_optimizer is not None
    hdo.param_groups[0]["lr"] = 0.25
    hdo.step()  # no gradients: nothing moves, but the settings are handed down
    for optimizer in hdo.sub_optimizers:
        for group in optimizer.param_groups:
            orig = hdo.inner_param_to_orig_param[group["params"][0]]
            expected = 0.25 if any(orig is p for p in hdo.param_groups[0]["params"]) else 1e-2 * 0.5 ** 4
            assert group["lr"] == expected


def test_zero_grad_clears_grads_and_decoupled_grads():
    (net,) = _nets(count=1)
    hdo = _hdo(net, "adamw", 0.5)
    _backward(net, 0)
    net.fc1.weight.decoupled_grad = torch.ones_like(net.fc1.weight)
    hdo.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in net.parameters() if p.grad is not None)
    assert torch.count_nonzero(net.fc1.weight.decoupled_grad) == 0
    hdo.zero_grad()
    assert all(p.grad is None for p in net.parameters()) and net.fc1.weight.decoupled_grad is None


def test_decoupled_grad_is_the_gradient_copied():
    """Copies take ``decoupled_grad`` (parameters updated in place leave it to the device optimizer)."""
    net, ref = _nets()
    hdo = _hdo(net, "sgd", 1.0)
    _backward(net, 0)
    _backward(ref, 0)
    for p in net.parameters():
        if p.grad is not None:
            p.decoupled_grad, p.grad = p.grad, None
    hdo.step()
    torch.optim.SGD(_groups(ref), **HPARAMS["sgd"][1]).step()
    _assert_same_params(net, ref)


def test_dummy_step_creates_state_and_copies_follow_the_params():
    (net,) = _nets(torch.bfloat16, count=1)
    hdo = _hdo(net, "adamw", 0.5, param_update_in_fp32=True)
    hdo.dummy_step()
    assert set(hdo.state) == set(net.parameters()) and all(p.grad is None for p in net.parameters())
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(0.5)
    hdo.update_fp32_param_by_new_param()
    assert all(torch.all(inner == 0.5) for inner in hdo.param_to_inner_param.values())
    orig = net.fc2.weight  # state written in model space, as Megatron's distributed optimizer does
    hdo.state[orig]["master_param"] = torch.full(orig.shape, 0.125)
    hdo._sync_hdo_state_to_sub_optimizers()
    assert torch.all(hdo.param_to_fp32_param[orig] == 0.125)
    assert hdo.state[orig]["master_param"] is hdo.param_to_inner_param[orig]


@pytest.mark.parametrize("fraction", [-0.1, 1.5, "half", True, float("nan")])
def test_bad_offload_fraction_raises(fraction):
    (net,) = _nets(count=1)
    with pytest.raises(ValueError, match="offload_fraction"):
        HybridDeviceOptimizer(net.parameters(), offload_fraction=fraction, cpu_optimizer_cls=torch.optim.SGD,
                              gpu_optimizer_cls=torch.optim.SGD, lr=0.1)


def test_missing_optimizer_class_raises():
    (net,) = _nets(count=1)
    with pytest.raises(ValueError, match="cpu_optimizer_cls is None"):
        HybridDeviceOptimizer(net.parameters(), offload_fraction=0.5, gpu_optimizer_cls=torch.optim.SGD, lr=0.1)
    assert HybridDeviceOptimizer(net.parameters(), offload_fraction=0.0,
                                 gpu_optimizer_cls=torch.optim.SGD, lr=0.1).cpu_optimizers == []


@pytest.mark.gpu
@pytest.mark.parametrize(("fraction", "fp32_update"), [(0.5, False), (1.0, False), (0.5, True)])
def test_cuda_params_with_overlap_equal_the_plain_optimizer(fraction, fp32_update):
    dtype = torch.bfloat16 if fp32_update else torch.float32
    net, ref = _nets(dtype, device="cuda")
    hdo = _hdo(net, "adamw", fraction, param_update_in_fp32=fp32_update, overlap_cpu_optimizer_d2h_h2d=True)
    assert hdo._d2h_stream != torch.cuda.current_stream() and hdo._h2d_stream != hdo._d2h_stream
    assert all(c.is_pinned() and c.is_cpu for c in hdo.gpu_params_map_cpu_copy.values())
    _train(net, hdo, range(5))
    torch.cuda.synchronize()
    if fp32_update:  # reference: fp32 masters on the GPU, rounded to bf16 after each step
        masters = [p.detach().float() for p in ref.parameters()]
        index = {p: i for i, p in enumerate(ref.parameters())}
        plain = torch.optim.AdamW([{**g, "params": [masters[index[p]] for p in g["params"]]}
                                   for g in _groups(ref)], **HPARAMS["adamw"][1])
        for step in range(5):
            ref.zero_grad()
            _backward(ref, step)
            for p, master in zip(ref.parameters(), masters):
                master.grad = None if p.grad is None else p.grad.float()
            plain.step()
            with torch.no_grad():
                for p, master in zip(ref.parameters(), masters):
                    p.copy_(master)
        for p, master in zip(net.parameters(), masters):  # CPU and CUDA AdamW may differ in the last bits
            if p.grad is not None:
                torch.testing.assert_close(hdo.state[p]["master_param"].cuda(), master, rtol=1e-5, atol=1e-6)
        _assert_same_params(net, ref, atol=1e-2)  # one bf16 ulp at most
    else:
        _train(ref, torch.optim.AdamW(_groups(ref), **HPARAMS["adamw"][1]), range(5))
        _assert_same_params(net, ref, atol=1e-6)
    for p in net.parameters():
        if p.grad is not None:
            assert hdo.state[p]["exp_avg"].is_cuda == (p not in hdo.gpu_params_map_cpu_copy)
