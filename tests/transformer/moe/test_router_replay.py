"""Routing replay (``moe_enable_routing_replay``, ``transformer.moe.router_replay``).

- Routing under replay equals Megatron-Core's (the installed megatron-core as an oracle) for every score function.
- A recorded routing replayed into a model whose router has changed routes exactly as recorded, with
  probabilities from the new scores, and the router still gets gradients.
- ``REPLAY_BACKWARD`` feeds the recompute of ``"moe"`` activation recompute: gradients equal those of a run
  without recompute.
- Errors name the layer and the shapes.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron_core.transformer.moe.router import TopKRouter
from megatron_core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from tests.transformer.moe.moe_parallel_utils import batches, build


@pytest.fixture(autouse=True)
def _no_routers_left():
    """Every test starts and ends with no registered replay instances."""
    RouterReplay.clear_global_router_replay_instances()
    yield
    RouterReplay.clear_global_router_replay_instances()


ROUTINGS = [
    dict(score_function="softmax"),
    dict(score_function="softmax", use_pre_softmax=True),
    dict(score_function="sigmoid", expert_bias=True),
    dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5),
]


def _reference_module():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
        replay = pytest.importorskip("megatron.core.transformer.moe.router_replay")
    return moe_utils, replay


@pytest.mark.parametrize("routing", ROUTINGS)
def test_record_and_replay_match_megatron_core(routing: dict):
    moe_utils, reference = _reference_module()
    torch.manual_seed(0)
    logits = torch.randn(12, 8)
    kwargs = dict(routing)
    if kwargs.pop("expert_bias", False):
        kwargs["expert_bias"] = torch.randn(8) * 0.1
    ours, theirs = RouterReplay(), reference.RouterReplay()
    ours.set_router_replay_action(RouterReplayAction.RECORD)
    theirs.set_router_replay_action(reference.RouterReplayAction.RECORD)
    got = topk_routing_with_score_function(logits, 2, router_replay=ours, **kwargs)
    want = moe_utils.topk_routing_with_score_function(logits, 2, router_replay=theirs, **kwargs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(ours.get_recorded_indices(), theirs.get_recorded_indices(), rtol=0, atol=0)

    target = torch.stack([torch.randperm(8)[:2] for _ in range(12)])  # indices the router would not pick
    ours.set_target_indices(target)
    theirs.set_target_indices(target)
    ours.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    theirs.set_router_replay_action(reference.RouterReplayAction.REPLAY_FORWARD)
    got = topk_routing_with_score_function(logits, 2, router_replay=ours, **kwargs)
    want = moe_utils.topk_routing_with_score_function(logits, 2, router_replay=theirs, **kwargs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    routing_map = got[1]
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, target, True))


def _routers(model: torch.nn.Module) -> list[TopKRouter]:
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def _step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ids, pos, labels = batches(1)[0]
    loss = model(ids, pos, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _maps(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each router's routing map of the last forward (through a hook)."""
    return [router._last_map for router in _routers(model)]


def _watch_maps(model: torch.nn.Module) -> None:
    for router in _routers(model):
        def hook(module, inputs, outputs):
            module._last_map = outputs[1].clone()
        router.register_forward_hook(hook)


def test_replay_routes_a_changed_model_as_recorded_and_trains_its_router():
    torch.manual_seed(1)
    model = build("mixtral", moe_enable_routing_replay=True)
    _watch_maps(model)
    assert RouterReplay.global_router_replay_instances == [r.router_replay for r in _routers(model)]
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    _step(model)
    recorded, recorded_maps = RouterReplay.get_recorded_data(), _maps(model)
    assert all(r is not None and r.shape == (batches(1)[0][0].numel(), 2) for r in recorded)

    with torch.no_grad():  # another policy: its own routing differs
        for router in _routers(model):
            router.weight.copy_(torch.randn_like(router.weight))
    RouterReplay.clear_global_router_replay_action()
    _step(model)
    assert any(not torch.equal(a, b) for a, b in zip(_maps(model), recorded_maps))

    RouterReplay.set_replay_data(recorded)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    _, grads = _step(model)
    for got, want in zip(_maps(model), recorded_maps):
        assert torch.equal(got, want)
    assert all(grads[n].abs().sum() > 0 for n in grads if n.endswith("router.weight"))


def test_replay_backward_feeds_moe_recompute():
    """With ``"moe"`` recompute the layer reruns in the backward; ``REPLAY_BACKWARD`` gives the rerun the same
    indices, so loss and gradients equal a replayed run without recompute."""
    torch.manual_seed(2)
    plain = build("mixtral", moe_enable_routing_replay=True)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    _step(plain)
    recorded = [r.clone() for r in RouterReplay.get_recorded_data()]
    with torch.no_grad():
        for router in _routers(plain):
            router.weight.mul_(-1.0)  # the replayed routing is now far from the router's own
    RouterReplay.set_replay_data(recorded)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    want_loss, want = _step(plain)

    RouterReplay.clear_global_router_replay_instances()
    recomputed = build("mixtral", moe_enable_routing_replay=True, recompute_granularity="selective",
                       recompute_modules=["moe"])
    recomputed.load_state_dict(plain.state_dict())
    RouterReplay.set_replay_data(recorded)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    recomputed.zero_grad(set_to_none=True)
    ids, pos, labels = batches(1)[0]
    loss = recomputed(ids, pos, None, labels=labels).mean()
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss, rtol=0, atol=0)
    for name, param in recomputed.named_parameters():
        torch.testing.assert_close(param.grad, want[name], rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert all(not r.router_replay.replay_backward_list for r in _routers(recomputed))


def test_static_buffer_records_into_fixed_memory():
    model = build("mixtral", moe_enable_routing_replay=True)
    tokens = batches(1)[0][0].numel()
    buffer = torch.full((tokens + 5, len(_routers(model)), 2), -1, dtype=torch.long)
    RouterReplay.set_global_static_buffers(buffer)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    _step(model)
    for layer, recorded in enumerate(RouterReplay.get_recorded_data()):
        assert recorded.data_ptr() == buffer[:, layer, :].data_ptr()
        assert torch.equal(buffer[:tokens, layer], recorded) and (buffer[tokens:, layer] == -1).all()
    with pytest.raises(ValueError, match="static buffer must be"):
        RouterReplay.set_global_static_buffers(torch.zeros(4, 7, 2, dtype=torch.long))


def test_bad_replay_data_is_refused_naming_the_counts_and_shapes():
    model = build("mixtral", moe_enable_routing_replay=True)
    with pytest.raises(ValueError, match="indices for 1 layers; there are 2 routers"):
        RouterReplay.set_replay_data([torch.zeros(3, 2, dtype=torch.long)])
    RouterReplay.set_replay_data([torch.zeros(3, 2, dtype=torch.long)] * 2)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises(ValueError, match=r"replayed indices have shape \(3, 2\)"):
        _step(model)
    RouterReplay.clear_global_indices()
    with pytest.raises(ValueError, match="without indices"):
        _step(model)


def test_routers_without_the_flag_have_no_replay():
    model = build("mixtral")
    assert all(r.router_replay is None for r in _routers(model))
    assert RouterReplay.global_router_replay_instances == []
