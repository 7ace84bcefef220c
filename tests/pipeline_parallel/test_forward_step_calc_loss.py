"""schedules.forward_step_calc_loss and the DSA indexer loss's backward scale (Megatron-Core 0.19)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_core.pipeline_parallel import schedules
from megatron_core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler


def _config(**kw):
    base = dict(calculate_per_token_loss=False, experimental_attention_variant_loss_scale_func=None,
                experimental_attention_variant="dsa", grad_scale_func=lambda t: t * 3.0, num_moe_experts=None,
                mtp_num_layers=None, timers=None)
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(autouse=True)
def _reset_scale():
    DSAIndexerLossAutoScaler.main_loss_backward_scale = None
    yield
    DSAIndexerLossAutoScaler.main_loss_backward_scale = None


@pytest.mark.parametrize("per_token, loss, scale", [(False, 1.0, 6.0), (True, 8.0, 3.0)])
def test_loss_and_indexer_scale_follow_the_main_loss(per_token, loss, scale):
    store = []
    out, tokens = schedules.forward_step_calc_loss(
        None, torch.tensor(8.0), lambda t: (t.clone(), torch.tensor(4), {"lm": t.detach()}),
        _config(calculate_per_token_loss=per_token), None, False, 2, store, cp_group_size=4, is_last_stage=True)
    assert out.item() == loss and tokens.item() == 4 and store[0]["lm"].item() == 8.0  # (8 / 4) / 2 micro-batches
    torch.testing.assert_close(DSAIndexerLossAutoScaler.main_loss_backward_scale, torch.tensor([scale]))


def test_without_loss_func_the_output_is_stored_and_custom_hooks_win():
    seen = []
    store = []
    schedules.forward_step_calc_loss(None, {"loss": torch.tensor(8.0)}, None,
                                     _config(experimental_attention_variant_loss_scale_func=seen.append,
                                             calculate_per_token_loss=True),
                                     None, False, 2, store, cp_group_size=4, is_last_stage=True)
    assert store == [{"loss": torch.tensor(8.0)}] and torch.equal(seen[0], torch.tensor([3.0]))
    assert DSAIndexerLossAutoScaler.main_loss_backward_scale is None
    with pytest.raises(ValueError, match="cp_group_size"):
        schedules.forward_step_calc_loss(None, torch.tensor(1.0), None, _config(), None, False, 1, [],
                                         is_last_stage=True)


def test_indexer_loss_gets_the_set_scale_in_backward():
    DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(0.5))
    out = torch.ones(3, requires_grad=True)
    indexer_loss = torch.tensor(2.0, requires_grad=True)
    DSAIndexerLossAutoScaler.apply(out, indexer_loss).sum().backward()
    assert out.grad.tolist() == [1.0, 1.0, 1.0] and indexer_loss.grad.item() == 0.5
    with pytest.raises(TypeError):
        DSAIndexerLossAutoScaler.set_loss_scale(0.5)


class _Stage(torch.nn.Module):
    """A one-stage model: doubles its input."""

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors

    def forward(self, x):
        return 2 * x


@pytest.mark.parametrize("per_token, scale", [(False, 6.0), (True, 3.0)])
def test_forward_step_sets_the_indexer_scale_like_forward_step_calc_loss(per_token, scale):
    """``forward_step`` (what every schedule calls) scales the indexer loss as ``forward_step_calc_loss`` does: a DP
    replica's gradients are averaged, so an unscaled indexer loss weighed ``num_microbatches`` times too much."""
    def step(data_iterator, model):
        return model(next(data_iterator)), lambda t: (t.sum(), torch.tensor(4), {"lm": t.detach().sum()})

    schedules.forward_step(step, iter([torch.ones(2)]), _Stage(), 2, None, [],
                           _config(calculate_per_token_loss=per_token), cp_size=4)
    torch.testing.assert_close(DSAIndexerLossAutoScaler.main_loss_backward_scale, torch.tensor([scale]))
