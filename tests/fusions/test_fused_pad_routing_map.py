"""``fused_pad_routing_map`` against ``moe_utils.pad_routing_map`` (the unfused padding the dispatcher runs).

Same routes, returned as Megatron-Core's fused function returns them (``int32 [tokens, experts]``), for bool and
integer maps, strided inputs, multiples that some experts already meet, more tokens than one step of the kernel's
loop, and no tokens. The all-to-all dispatcher with ``moe_permute_fusion`` (experimental features on) pads the same.
The PyTorch path runs on CPU; the Triton kernel in Triton's interpreter (a subprocess) and on CUDA (GPU tests).
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.fusions import fused_pad_routing_map as fused_pad
from megatron_core.fusions.fused_pad_routing_map import fused_pad_routing_map
from megatron_core.transformer.moe.moe_utils import pad_routing_map
from tests.triton_interpreter import needs_triton, run_in_triton_interpreter

# (tokens, experts, pad_multiple, routed fraction)
CASES = [(37, 5, 8, 0.3), (64, 4, 16, 0.5), (2500, 3, 32, 0.1), (9, 6, 1, 0.4), (20, 3, 4, 1.0)]


def _map(tokens: int, experts: int, fraction: float, seed: int) -> torch.Tensor:
    return torch.rand(tokens, experts, generator=torch.Generator().manual_seed(seed)) < fraction


def _compare(device: str, case: tuple) -> None:
    tokens, experts, multiple, fraction = case
    routing_map = _map(tokens, experts, fraction, tokens)
    want = pad_routing_map(routing_map, multiple)
    for given in (routing_map, routing_map.to(torch.int32), routing_map.t().contiguous().t()):  # bool, int, strided
        before = given.clone()
        got = fused_pad_routing_map(given.to(device), multiple)
        assert got.dtype == torch.int32 and got.shape == (tokens, experts)
        assert torch.equal(got.cpu().bool(), want) and torch.equal(given, before)
        assert (got.sum(0) % multiple == 0).all() or (got.sum(0) == tokens).any()


@pytest.mark.parametrize("case", CASES, ids=["odd", "pow2", "long", "multiple_1", "full"])
def test_torch_path_matches_pad_routing_map(case):
    _compare("cpu", case)


def test_layout_no_tokens_and_errors():
    padded = fused_pad_routing_map(_map(10, 3, 0.3, 0), 4)
    assert padded.stride() == (1, 10)  # a transposed view of [experts, tokens], as Megatron-Core returns it
    empty = torch.zeros(0, 4, dtype=torch.bool)
    assert fused_pad_routing_map(empty, 8) is empty
    with pytest.raises(ValueError, match=r"pad_multiple \(0\)"):
        fused_pad_routing_map(empty, 0)
    with pytest.raises(ValueError, match=r"got shape \(4,\)"):
        fused_pad_routing_map(torch.zeros(4), 8)


def test_dispatcher_with_permute_fusion_pads_the_same(monkeypatch):
    from megatron_core import config as megatron_core_config
    from megatron_core.transformer.moe import token_dispatcher

    calls = []
    monkeypatch.setattr(token_dispatcher, "fused_pad_routing_map",
                        lambda m, p: calls.append(p) or fused_pad_routing_map(m, p))
    monkeypatch.setattr(megatron_core_config, "ENABLE_EXPERIMENTAL", True)
    outputs = []
    for fusion in (True, False):
        dispatcher = _alltoall_dispatcher(fusion)
        hidden = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
        routing_map = _map(6, 4, 0.4, 1)
        probs = torch.rand(6, 4, generator=torch.Generator().manual_seed(2)) * routing_map
        permuted, permuted_probs = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
        outputs.append((permuted, permuted_probs, dispatcher.routing_map, dispatcher.tokens_per_expert))
    assert calls == [16]
    for got, want in zip(*outputs):
        assert torch.equal(got, want)


def _alltoall_dispatcher(fusion: bool):
    from megatron_core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron_core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4,
                               moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_permute_fusion=fusion,
                               moe_router_padding_for_quantization=True, fp8="e4m3")
    return MoEAlltoAllTokenDispatcher(4, list(range(4)), config)


_INTERPRETER_SCRIPT = """
from megatron_core.fusions import fused_pad_routing_map
from tests.fusions import test_fused_pad_routing_map as t

fused_pad_routing_map._kernel_serves = lambda tensor: True  # CPU tensors through the kernel
for case in t.CASES:
    t._compare("cpu", case)
"""


@needs_triton
def test_kernel_in_the_triton_interpreter():
    run_in_triton_interpreter(_INTERPRETER_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [(65536, 64, 16, 0.125)], ids=["odd", "pow2", "long", "multiple_1", "full",
                                                                         "big"])
def test_kernel_matches_pad_routing_map_cuda(case):
    assert fused_pad._kernel_serves(torch.zeros(1, device="cuda"))
    _compare("cuda", case)
