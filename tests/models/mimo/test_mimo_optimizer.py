"""``MimoOptimizer`` on a heterogeneous colocated MIMO model equals one optimizer in one process (4 gloo ranks).

Encoder TP=1 x DP=4, language model TP=2 x DP=2, one Adam per module on its grid's groups, gradients summed
over each module's DP group: three steps with clipping by the global norm give the single-process run's
norms and weights. An inf gradient on one rank's encoder skips the step on every rank; a module that finds
inf/nan in ``prepare_grads`` on one rank does too, and one rank's failed update fails it everywhere;
``state_dict`` / ``load_state_dict`` and a ``dist_checkpointing`` save / load of ``sharded_state_dict`` resume
exactly. Non-colocated (encoder on rank 0, language model on rank 1): one step equals one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from megatron_core import dist_checkpointing
from megatron_core.models.mimo import get_mimo_optimizer
from megatron_core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.dist_harness import run_on_ranks
from tests.models.mimo import hetero_fixture as h

WORLD = 4
LAYOUT = (1, 4, 2, 2)
STEPS = 3


def _config() -> OptimizerConfig:
    # A small clip_grad so that clipping by the global norm acts on every step; adam_eps well above the
    # smallest gradients, so that Adam's g / sqrt(v) does not amplify fp32 summation-order noise in them.
    return OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=0.05, adam_eps=1e-4)


def _reference(steps: int) -> tuple[dict, list[float], list[dict]]:
    """One process, one optimizer over every parameter: initial weights, each step's norm and weights."""
    state = h.reference_state()
    model = h.make(h.config())
    model.load_state_dict(state, strict=False)
    opt = get_megatron_optimizer(_config(), [model])
    ids, labels, loss_mask, images = h.global_batch()
    norms, weights = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss, _ = model(ids, labels=labels, loss_mask=loss_mask, modality_inputs={"images": {"clip_encoder": {
            "x": images}}})
        (loss * loss_mask).sum().backward()
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
        weights.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return state, norms, weights


def _backward(hetero: h.Hetero) -> None:
    ids, labels, loss_mask, inputs, _ = hetero.local_batch()
    loss, mask = hetero.model(ids, labels=labels, loss_mask=loss_mask, modality_inputs=inputs)
    (loss * mask).sum().backward()
    hetero.sum_grads_over_dp()


def _train_step(hetero: h.Hetero, opt: MimoOptimizer) -> tuple[bool, float]:
    opt.zero_grad()
    _backward(hetero)
    ok, norm, _ = opt.step()
    return ok, norm


def _check_weights(hetero: h.Hetero, want: dict) -> None:
    for name, param in hetero.model.named_parameters():
        torch.testing.assert_close(hetero.full(name, param.detach()), want[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _steps_match() -> list[float]:
    state, ref_norms, ref_weights = _reference(STEPS)
    hetero = h.build(*LAYOUT, state)
    try:
        opt = get_mimo_optimizer(hetero.model, _config())
        assert set(opt.module_infos) == {"images", "language"} and all(
            i.is_active for i in opt.module_infos.values())
        assert dist.get_world_size(opt.module_infos["language"].pg_collection.tp) == 2
        norms = []
        for step in range(STEPS):
            ok, norm = _train_step(hetero, opt)
            assert ok
            assert norm == pytest.approx(ref_norms[step], rel=1e-5)
            _check_weights(hetero, ref_weights[step])
            norms.append(norm)
        return norms
    finally:
        h.destroy(hetero)


def test_per_module_optimizers_step_like_one_optimizer():
    norms = run_on_ranks(WORLD, _steps_match)
    assert all(n == norms[0] for n in norms) and min(norms[0]) > _config().clip_grad


def _skips() -> tuple:
    hetero = h.build(*LAYOUT, h.reference_state())
    try:
        opt = get_mimo_optimizer(hetero.model, _config())
        _backward(hetero)
        if dist.get_rank() == 0:
            next(hetero.model.modality_submodules.parameters()).grad.view(-1)[0] = float("inf")
        before = {k: v.detach().clone() for k, v in hetero.model.named_parameters()}
        ok, norm, _ = opt.step()
        for name, param in hetero.model.named_parameters():
            assert torch.equal(param, before[name]), name
        if dist.get_rank() == WORLD - 1:  # one rank's language module reports inf/nan from prepare_grads
            opt.module_infos["language"].optimizer.prepare_grads = lambda: True
        found = opt.step()
        return ok, norm, found
    finally:
        h.destroy(hetero)


def test_found_inf_on_one_rank_skips_the_step_everywhere():
    for ok, norm, found in run_on_ranks(WORLD, _skips):
        assert not ok and norm == float("inf")
        assert found == (False, None, None)


def _resumes() -> int:
    state, _, ref_weights = _reference(STEPS)
    first = h.build(*LAYOUT, state)
    second = h.build(*LAYOUT, state)
    try:
        opt = get_mimo_optimizer(first.model, _config())
        for _ in range(STEPS - 1):
            _train_step(first, opt)
        saved = copy.deepcopy(opt.state_dict())
        assert set(saved) == {"images", "language"}
        with torch.no_grad():
            for (_, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters()):
                b.copy_(a)
        resumed = get_mimo_optimizer(second.model, _config())
        resumed.load_state_dict(saved)
        _train_step(first, opt)
        _train_step(second, resumed)
        for (name, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters()):
            assert torch.equal(a, b), name
        _check_weights(second, ref_weights[-1])
        return len(resumed.param_groups)
    finally:
        h.destroy(first)
        h.destroy(second)


def test_state_dict_round_trip_resumes_exactly():
    assert min(run_on_ranks(WORLD, _resumes)) > 0


def test_stub_optimizer_and_missing_grid_map():
    opt = MimoOptimizer({"images": ModuleOptimizerInfo(None, None, None, False)}, _config())
    assert opt.is_stub_optimizer and opt.state_dict() == {"images": None} and opt.param_groups == []
    assert opt.get_loss_scale().item() == 1.0
    model = h.make(h.config())
    with pytest.raises(ValueError, match=r"get_mimo_optimizer needs MimoModelConfig.module_to_grid_map"):
        get_mimo_optimizer(model, _config())


def _sharded_resumes(directory: str) -> int:
    state, _, ref_weights = _reference(STEPS)
    first = h.build(*LAYOUT, state)
    second = h.build(*LAYOUT, state)
    try:
        opt = get_mimo_optimizer(first.model, _config())
        for _ in range(STEPS - 1):
            _train_step(first, opt)
        sharded = opt.sharded_state_dict(first.model.sharded_state_dict())
        dist_checkpointing.save({"optimizer": sharded}, directory)
        with torch.no_grad():
            for (_, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters()):
                b.copy_(a)
        resumed = get_mimo_optimizer(second.model, _config())
        template = resumed.sharded_state_dict(second.model.sharded_state_dict(), is_loading=True,
                                              state_names=["exp_avg", "exp_avg_sq"])
        resumed.load_state_dict(dist_checkpointing.load({"optimizer": template}, directory)["optimizer"])
        _train_step(first, opt)
        _train_step(second, resumed)
        for (name, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters()):
            assert torch.equal(a, b), name
        _check_weights(second, ref_weights[-1])
        return len(resumed.param_groups)
    finally:
        h.destroy(first)
        h.destroy(second)


def test_sharded_state_dict_round_trip_resumes_exactly(tmp_path):
    assert min(run_on_ranks(WORLD, _sharded_resumes, str(tmp_path))) > 0


def _non_colocated_step() -> tuple[bool, float, list[str]]:
    """Encoder on rank 0, language model on rank 1 (embeddings sent by hand); one MimoOptimizer step."""
    state, ref_norms, ref_weights = _reference(1)
    grids = {"images": h.grid_on([1, 1, 1, 1], 0), "language": h.grid_on([1, 1, 1, 1], 1)}
    model = h.make(h.config(grid_map=grids))
    model.load_state_dict(state, strict=False)
    opt = get_mimo_optimizer(model, _config())
    ids, labels, loss_mask, images = h.global_batch()
    count = int((ids == h.f.IMAGE_TOKEN_ID).sum())
    if dist.get_rank() == 0:
        out, _ = model(ids, modality_inputs={"images": {"clip_encoder": {"x": images}}})
        dist.send(out["images"].detach().contiguous(), dst=1)
        grad = torch.empty_like(out["images"])
        dist.recv(grad, src=1)
        out["images"].backward(grad)
    else:
        received = torch.empty(count, model.config.hidden_size, requires_grad=True)
        dist.recv(received.data, src=0)
        model.set_input_tensor({"images": [received]})
        loss, mask = model(ids, labels=labels, loss_mask=loss_mask)
        (loss * mask).sum().backward()
        dist.send(received.grad.contiguous(), dst=0)
    ok, norm, _ = opt.step()
    assert norm == pytest.approx(ref_norms[0], rel=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), ref_weights[0][name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    active = sorted(name for name, info in opt.module_infos.items() if info.is_active)
    for g in grids.values():
        g.destroy()
    return ok, norm, active


def test_non_colocated_modules_step_with_one_global_norm():
    results = run_on_ranks(2, _non_colocated_step)
    assert [r[2] for r in results] == [["images"], ["language"]]
    assert all(r[0] for r in results) and results[0][1] == results[1][1]


def _success_consensus() -> tuple:
    opt = MimoOptimizer({}, OptimizerConfig(lr=1e-3, log_num_zeros_in_grad=False))
    last = dist.get_world_size() - 1
    opt.step_with_ready_grads = lambda: dist.get_rank() != last
    return opt.step()


def test_update_success_is_agreed_over_the_world():
    assert run_on_ranks(2, _success_consensus) == [(False, 0.0, None)] * 2
