"""``fused_indices_to_multihot`` against a direct construction of the routing map from the top-k slots.

The reference adds one-hot rows slot by slot (Megatron-Core's unfused ``_indices_to_multihot``: ``-1`` means no local expert);
the probabilities' gradient is checked through a loss that mixes tokens and experts. Token, top-k and expert counts
that are not powers of two, more experts than one step of the kernel's loop, int32 and int64 indices. The PyTorch
path runs on CPU; the Triton kernels in Triton's interpreter (a subprocess) and on CUDA (GPU tests).
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.fusions import fused_indices_converter
from megatron_core.fusions.fused_indices_converter import IndicesToMultihot, fused_indices_to_multihot
from tests.triton_interpreter import needs_triton, run_in_triton_interpreter

# (tokens, topk, local experts)
SHAPES = [(5, 2, 4), (13, 6, 7), (33, 8, 31), (9, 3, 200)]


def _slots(tokens: int, topk: int, experts: int, seed: int, dtype: torch.dtype = torch.int32):
    """Distinct local experts in some slots of each row, -1 (another rank's expert) in the rest."""
    gen = torch.Generator().manual_seed(seed)
    indices = torch.full((tokens, topk), -1, dtype=dtype)
    probs = torch.zeros(tokens, topk)
    for row in range(tokens):
        used = int(torch.randint(0, min(topk, experts) + 1, (1,), generator=gen))
        slots = torch.randperm(topk, generator=gen)[:used]
        indices[row, slots] = torch.randperm(experts, generator=gen)[:used].to(dtype)
        probs[row, slots] = torch.rand(used, generator=gen)
    return indices, probs


def _reference(indices: torch.Tensor, probs: torch.Tensor, experts: int):
    """Slot by slot: a one-hot row of the slot's expert (none for -1), weighted by the slot's probability."""
    routing_map = torch.zeros(indices.shape[0], experts, dtype=torch.bool)
    multihot = torch.zeros(indices.shape[0], experts, dtype=probs.dtype)
    for slot in range(indices.shape[1]):
        local = (indices[:, slot] != -1)[:, None]
        one_hot = torch.nn.functional.one_hot(indices[:, slot].long().clamp(min=0), experts).bool() & local
        routing_map |= one_hot
        multihot = multihot + one_hot * probs[:, slot:slot + 1]
    return routing_map, multihot


def _compare(device: str, shape: tuple, index_dtype: torch.dtype = torch.int32, dtype=torch.float32) -> None:
    tokens, topk, experts = shape
    indices, probs = _slots(tokens, topk, experts, sum(shape), index_dtype)
    weight = torch.randn(experts, experts, generator=torch.Generator().manual_seed(3))
    ref_probs = probs.to(dtype).float().clone().requires_grad_(True)  # the values the kernel sees, in fp32
    want_map, want = _reference(indices, ref_probs, experts)
    (want @ weight @ want.t()).sum().backward()

    got_probs = probs.to(device, dtype).detach().clone().requires_grad_(True)
    got_map, got = fused_indices_to_multihot(indices.to(device), got_probs, experts)
    (got.float() @ weight.to(device) @ got.float().t()).sum().backward()
    assert got_map.dtype == torch.bool and got.dtype == dtype and got.shape == (tokens, experts)
    assert torch.equal(got_map.cpu(), want_map)
    torch.testing.assert_close(got.cpu().float(), want.detach(), rtol=0, atol=0 if dtype == torch.float32 else 4e-3)
    # The probabilities' gradient goes through a quadratic loss whose matmuls sum in another order on a GPU (and a
    # bf16 gradient is rounded once): compared to the size of the largest gradient.
    scale = ref_probs.grad.abs().max().item()
    tol = dict(rtol=1e-5, atol=1e-5 * scale) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2 * scale)
    torch.testing.assert_close(got_probs.grad.cpu().float(), ref_probs.grad, **tol)


@pytest.mark.parametrize("shape", SHAPES, ids=["small", "odd", "31_experts", "200_experts"])
def test_torch_path_matches_reference(shape):
    _compare("cpu", shape)


def test_int64_indices_and_no_tokens():
    _compare("cpu", SHAPES[1], torch.int64)
    routing_map, probs = fused_indices_to_multihot(torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2), 4)
    assert routing_map.shape == probs.shape == (0, 4)


def test_slots_outside_the_local_experts_are_ignored_and_repeats_add_up():
    indices = torch.tensor([[0, 5, -3], [2, 2, -1]])
    probs = torch.tensor([[0.5, 0.25, 0.125], [0.25, 0.5, 1.0]], requires_grad=True)
    routing_map, multihot = fused_indices_to_multihot(indices, probs, 4)
    assert routing_map.tolist() == [[True, False, False, False], [False, False, True, False]]
    assert multihot.tolist() == [[0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.75, 0.0]]
    (multihot * torch.arange(1.0, 5.0)).sum().backward()
    assert probs.grad.tolist() == [[1.0, 0.0, 0.0], [3.0, 3.0, 0.0]]


def test_autograd_function_and_errors():
    assert issubclass(IndicesToMultihot, torch.autograd.Function)
    with pytest.raises(ValueError, match=r"indices \(3, 2\) and probs_indices \(3, 3\)"):
        fused_indices_to_multihot(torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 3), 4)
    with pytest.raises(ValueError, match=r"num_of_local_experts \(0\)"):
        fused_indices_to_multihot(torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2), 0)
    with pytest.raises(ValueError, match="must be integers"):
        fused_indices_to_multihot(torch.zeros(3, 2), torch.zeros(3, 2), 4)


_INTERPRETER_SCRIPT = """
import torch
from megatron_core.fusions import fused_indices_converter
from tests.fusions import test_fused_indices_converter as t

fused_indices_converter._kernels_serve = lambda tensor: True  # CPU tensors through the kernels
for shape in t.SHAPES:
    t._compare("cpu", shape)
t._compare("cpu", t.SHAPES[1], torch.int64)
t.test_slots_outside_the_local_experts_are_ignored_and_repeats_add_up()
"""


@needs_triton
def test_kernels_in_the_triton_interpreter():
    run_in_triton_interpreter(_INTERPRETER_SCRIPT)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES + [(4096, 8, 64)], ids=["small", "odd", "31_experts", "200_experts", "big"])
def test_kernels_match_reference_cuda(shape, dtype):
    assert fused_indices_converter._kernels_serve(torch.zeros(1, device="cuda"))
    _compare("cuda", shape, dtype=dtype)
