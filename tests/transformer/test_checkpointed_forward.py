"""``recompute.checkpointed_forward`` (full activation recompute) equals the run without recompute.

For a GPT ``TransformerBlock`` and a hybrid ``HybridStack`` (Mamba, attention, MLP and MoE layers), every
``recompute_method`` / ``recompute_num_layers`` gives the same loss and every gradient (fp32, 1e-6) on identical
weights, also with dropout on (the checkpoint replays the RNG states); intermediate outputs come back at the
requested layers.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import recompute
from megatron_core.transformer import full_recompute
from tests.models.gpt_test_utils import batch, build, llama_like
from tests.models.mamba.mamba_test_utils import VOCAB
from tests.models.mamba.mamba_test_utils import batch as hybrid_batch
from tests.models.mamba.mamba_test_utils import config as hybrid_config

RECOMPUTE = [
    dict(recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_method="uniform", recompute_num_layers=2),
    dict(recompute_method="uniform", recompute_num_layers=3),
    dict(recompute_method="block", recompute_num_layers=1),
    dict(recompute_method="block", recompute_num_layers=3),
]


def _loss_and_grads(model: torch.nn.Module, inputs: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids, pos, labels = inputs
    torch.manual_seed(11)  # the dropout masks of the forward
    loss = model(ids, pos, None, labels=labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ref: tuple, got: tuple) -> None:
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    assert ref[1].keys() == got[1].keys()
    for name, grad in ref[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-6, atol=1e-6, msg=name)


def test_recompute_path_is_the_transformer_function():
    assert recompute.checkpointed_forward is full_recompute.checkpointed_forward


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("settings", RECOMPUTE, ids=lambda s: f"{s['recompute_method']}{s['recompute_num_layers']}")
def test_transformer_block_recompute_equals_no_recompute(settings: dict, dropout: float):
    spec = llama_like(num_layers=4, hidden_dropout=dropout)
    torch.manual_seed(0)
    ref_model = build(spec)
    torch.manual_seed(0)
    model = build(spec, recompute_granularity="full", **settings)
    model.load_state_dict(ref_model.state_dict())
    _assert_same(_loss_and_grads(ref_model, batch()), _loss_and_grads(model, batch()))


def _hybrid(pattern: str, **overrides):
    from megatron_core.models.hybrid import HybridModel
    from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16) if "E" in pattern else {}
    return HybridModel(hybrid_config(pattern, **moe, **overrides), hybrid_stack_spec, VOCAB, 32,
                       hybrid_layer_pattern=pattern, position_embedding_type="rope")


@pytest.mark.parametrize("settings", RECOMPUTE, ids=lambda s: f"{s['recompute_method']}{s['recompute_num_layers']}")
def test_hybrid_stack_recompute_equals_no_recompute(settings: dict):
    pattern = "M*-ME"
    torch.manual_seed(0)
    ref_model = _hybrid(pattern, hidden_dropout=0.1)
    torch.manual_seed(0)
    model = _hybrid(pattern, hidden_dropout=0.1, recompute_granularity="full", **settings)
    model.load_state_dict(ref_model.state_dict())
    _assert_same(_loss_and_grads(ref_model, hybrid_batch()), _loss_and_grads(model, hybrid_batch()))


def test_recompute_runs_the_layers_again_in_backward():
    """The forward of a checkpointed layer runs twice (forward and backward), a layer outside ``block``'s window once."""
    torch.manual_seed(0)
    model = build(llama_like(num_layers=3), recompute_granularity="full", recompute_method="block",
                  recompute_num_layers=2)
    calls = [0, 0, 0]
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    _loss_and_grads(model, batch())
    assert calls == [2, 2, 1]


@pytest.mark.parametrize("method,expected", [("uniform", [1, 3]), ("block", [0, 1, 2, 3])])
def test_extract_layer_indices_returns_the_requested_outputs(method: str, expected: list[int]):
    """``uniform`` keeps a group's output when its last layer is listed, ``block`` a layer's when it is listed;
    each kept tensor equals the output of that layer in a plain run."""
    torch.manual_seed(0)
    model = build(llama_like(num_layers=4), recompute_granularity="full", recompute_method=method,
                  recompute_num_layers=2 if method == "uniform" else 4)
    block = model.decoder
    hidden = torch.randn(8, 2, 32, requires_grad=True)
    plain = []
    h = hidden
    with torch.no_grad():
        for layer in block.layers:
            h, _ = layer(h, attention_mask=None)
            plain.append(h)
    out, kept = full_recompute.checkpointed_forward(block, hidden, None, None, None, None, None, None, False,
                                                    extract_layer_indices={0, 1, 2, 3}, layer_offset=0)
    assert len(kept) == len(expected)
    for tensor, index in zip(kept, expected):
        torch.testing.assert_close(tensor.detach(), plain[index], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.detach(), plain[-1], rtol=1e-6, atol=1e-6)
