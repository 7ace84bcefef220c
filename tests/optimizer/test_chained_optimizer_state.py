"""``ChainedOptimizer.state`` is Megatron-Core 0.19's ``ProxyDict``: a live view keyed ``(index, param)``."""

from __future__ import annotations

import torch

from megatron_core.optimizer import ChainedOptimizer
from megatron_core.optimizer.optimizer import ProxyDict


def _chained() -> tuple[ChainedOptimizer, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    optimizers = [torch.optim.Adam([params[0]], lr=0.1), torch.optim.Adam([params[1]], lr=0.1)]
    for p in params:
        p.grad = torch.ones_like(p)
    for opt in optimizers:
        opt.step()
    return ChainedOptimizer(optimizers), params


def test_state_is_a_view_over_each_sub_optimizer():
    chained, params = _chained()
    state = chained.state
    assert isinstance(state, ProxyDict)
    assert len(state) == 2 and list(state) == [(0, params[0]), (1, params[1])]
    assert state[(1, params[1])] is chained.chained_optimizers[1].state[params[1]]
    assert state[(0, params[1])] is None  # not that sub-optimizer's parameter
    assert (0, params[0]) in state and (1, params[0]) not in state
    state[(0, params[0])] = {"marker": 1}  # writes reach the owning sub-optimizer
    assert chained.chained_optimizers[0].state[params[0]] == {"marker": 1}
    assert dict(state.items())[(0, params[0])] == {"marker": 1}
