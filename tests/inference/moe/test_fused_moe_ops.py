"""``inference.moe`` ops against a per-expert reference loop on the same weights and routing (fp32).

Dense routing ``[max_tokens, topk]`` with only the first ``valid_tokens`` rows valid and only the experts of
this rank local; permute/unpermute round trips; ``mcore_fused_moe`` and ``vllm_fused_moe`` against the loop;
the MXFP8 and NVLS parts refused by name.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from megatron_core.inference.moe import (
    ActivationType,
    InferenceGroupedGemmBackend,
    mcore_fused_moe,
    vllm_fused_moe,
)
from megatron_core.inference.moe.activations import padded_squared_relu, squared_relu_and_quantize_mxfp8
from megatron_core.inference.moe.metadata import fused_metadata_update
from megatron_core.inference.moe.permute import (
    compute_expert_offsets,
    compute_local_tokens_per_expert,
    init_permutation_map,
    permute_and_quantize_mxfp8,
    permute_tokens,
    unpermute_tokens,
)

MAX_TOKENS, HIDDEN, FFN, EXPERTS, TOPK = 11, 8, 6, 6, 3
LOCAL_START, LOCAL_EXPERTS = 2, 3  # this rank holds experts 2, 3, 4


def _routing(seed: int = 0, topk: int = TOPK, hidden_size: int = HIDDEN
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(MAX_TOKENS, hidden_size, generator=gen)
    probs = torch.rand(MAX_TOKENS, topk, generator=gen)
    routing = torch.stack([torch.randperm(EXPERTS, generator=gen)[:topk] for _ in range(MAX_TOKENS)])
    return hidden, probs, routing


def _local_pairs(routing: torch.Tensor, valid: int) -> list[tuple[int, int, int]]:
    """(local expert, token, slot) of every valid local pair, in (token, slot) order."""
    return [(int(routing[t, k]) - LOCAL_START, t, k) for t in range(valid) for k in range(routing.shape[1])
            if LOCAL_START <= int(routing[t, k]) < LOCAL_START + LOCAL_EXPERTS]


@pytest.mark.parametrize("alignment", [1, 4])
@pytest.mark.parametrize("valid", [MAX_TOKENS, 7, 0])
def test_permute_groups_local_pairs_by_expert_and_unpermute_sums_them_back(alignment: int, valid: int):
    hidden, probs, routing = _routing()
    valid_tokens = torch.tensor([valid], dtype=torch.int32)
    pairs = _local_pairs(routing, valid)
    counts = [sum(1 for e, _, _ in pairs if e == expert) for expert in range(LOCAL_EXPERTS)]
    got_counts = compute_local_tokens_per_expert(routing, LOCAL_START, LOCAL_EXPERTS, valid_tokens)
    assert got_counts.dtype == torch.int32 and got_counts.tolist() == counts

    permuted, permuted_probs, perm_map, offs = permute_tokens(hidden, probs, routing, LOCAL_START, LOCAL_EXPERTS,
                                                              valid_tokens, alignment)
    aligned = [-(-c // alignment) * alignment for c in counts]
    assert offs.tolist() == torch.tensor(aligned).cumsum(0).tolist()
    assert permuted.shape == (MAX_TOKENS * TOPK + alignment * LOCAL_EXPERTS, HIDDEN)
    start = 0
    for expert in range(LOCAL_EXPERTS):
        mine = [(t, k) for e, t, k in pairs if e == expert]
        block = slice(start, start + len(mine))
        assert perm_map[block].tolist() == [t for t, _ in mine]
        assert_close(permuted[block], hidden[[t for t, _ in mine]].reshape(-1, HIDDEN), rtol=0, atol=0)
        assert_close(permuted_probs[block], torch.tensor([float(probs[t, k]) for t, k in mine]), rtol=0, atol=0)
        pad = slice(start + len(mine), start + aligned[expert])
        assert (perm_map[pad] == -1).all() and (permuted[pad] == 0).all()
        start += aligned[expert]
    assert (perm_map[start:] == -1).all() and (permuted[start:] == 0).all()

    out = unpermute_tokens(permuted, permuted_probs, perm_map, MAX_TOKENS, offs[-1:], valid_tokens)
    expected = torch.zeros(MAX_TOKENS, HIDDEN)
    for _, t, k in pairs:
        expected[t] += probs[t, k] * hidden[t]
    assert out.dtype == torch.float32
    assert_close(out, expected, rtol=1e-6, atol=1e-6)

    into = torch.full((MAX_TOKENS, HIDDEN), 7.0)
    unpermute_tokens(permuted, permuted_probs, perm_map, MAX_TOKENS, offs[-1:], valid_tokens, out=into)
    assert_close(into[:valid], expected[:valid], rtol=1e-6, atol=1e-6)
    assert (into[valid:] == 7.0).all()  # rows past the valid tokens are left as they were


def test_offsets_and_permutation_map_helpers():
    exclusive, inclusive = compute_expert_offsets(torch.tensor([3, 0, 5], dtype=torch.int32), alignment=4)
    assert exclusive.tolist() == [0, 4, 4] and inclusive.tolist() == [4, 4, 12]
    assert exclusive.dtype == torch.int32
    perm = torch.arange(6, dtype=torch.int32)
    init_permutation_map(perm, torch.tensor([4], dtype=torch.int32))
    assert perm.tolist() == [-1, -1, -1, -1, 4, 5]
    with pytest.raises(ValueError, match="alignment"):
        compute_expert_offsets(torch.tensor([1]), alignment=0)


def test_padded_squared_relu_skips_padding_and_unused_rows():
    x = torch.randn(6, 4)
    perm = torch.tensor([0, -1, 2, 3, 1, 0], dtype=torch.int32)
    got = padded_squared_relu(x, perm, torch.tensor([4], dtype=torch.int32))
    expected = torch.relu(x).square()
    expected[[1, 4, 5]] = 0
    assert_close(got, expected, rtol=0, atol=0)


def _weights(seed: int = 1, hidden_size: int = HIDDEN, ffn: int = FFN) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(LOCAL_EXPERTS, ffn, hidden_size, generator=gen) * 0.3,
            torch.randn(LOCAL_EXPERTS, hidden_size, ffn, generator=gen) * 0.3)


def _reference_moe(hidden, probs, routing, fc1, fc2, valid: int) -> torch.Tensor:
    """Each valid token's sum over its local slots of ``p * fc2(relu(fc1 x)^2)``, one expert at a time."""
    out = torch.zeros(hidden.shape[0], hidden.shape[1])
    for expert, t, k in _local_pairs(routing, valid):
        act = torch.relu(hidden[t] @ fc1[expert].t()).square()
        out[t] += probs[t, k] * (act @ fc2[expert].t())
    return out


@pytest.mark.parametrize("fused_moe", [mcore_fused_moe, vllm_fused_moe])
@pytest.mark.parametrize("valid", [MAX_TOKENS, 5])
def test_fused_moe_equals_a_per_expert_loop(fused_moe, valid: int):
    hidden, probs, routing = _routing(seed=3)
    fc1, fc2 = _weights()
    valid_tokens = torch.tensor([valid], dtype=torch.int32)
    got = fused_moe(hidden, probs, fc1, fc2, ActivationType.SQUARED_RELU, LOCAL_EXPERTS, LOCAL_START, valid_tokens,
                    routing)
    assert got.dtype == torch.float32 and got.shape == (MAX_TOKENS, HIDDEN)
    expected = _reference_moe(hidden, probs, routing, fc1, fc2, valid)
    assert_close(got, expected, rtol=1e-6, atol=1e-6)
    into = torch.full((MAX_TOKENS, HIDDEN), -3.0)
    fused_moe(hidden, probs, fc1, fc2, ActivationType.SQUARED_RELU, LOCAL_EXPERTS, LOCAL_START, valid_tokens,
              routing, out=into)
    assert_close(into[:valid], expected[:valid], rtol=1e-6, atol=1e-6)
    assert (into[valid:] == -3.0).all()


def test_fused_moe_over_all_ranks_experts_sums_to_the_whole_moe():
    """Two ranks' local experts (0-2 and 3-5) together give every slot of every token."""
    hidden, probs, routing = _routing(seed=5, topk=2)
    gen = torch.Generator().manual_seed(2)
    fc1, fc2 = torch.randn(EXPERTS, FFN, HIDDEN, generator=gen), torch.randn(EXPERTS, HIDDEN, FFN, generator=gen)
    valid = torch.tensor([MAX_TOKENS], dtype=torch.int32)
    total = sum(mcore_fused_moe(hidden, probs, fc1[s:s + 3], fc2[s:s + 3], ActivationType.SQUARED_RELU, 3, s, valid,
                                routing) for s in (0, 3))
    expected = torch.zeros(MAX_TOKENS, HIDDEN)
    for t in range(MAX_TOKENS):
        for k in range(2):
            e = int(routing[t, k])
            expected[t] += probs[t, k] * (torch.relu(hidden[t] @ fc1[e].t()).square() @ fc2[e].t())
    assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_backend_enum_matches_the_config_strings():
    assert {b.value for b in InferenceGroupedGemmBackend} == {"flashinfer", "torch", "vllm"}
    assert InferenceGroupedGemmBackend("vllm") is InferenceGroupedGemmBackend.VLLM


def test_mxfp8_and_nvls_parts_are_refused_by_name():
    hidden, probs, routing = _routing()
    valid = torch.tensor([MAX_TOKENS], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="MXFP8"):
        permute_and_quantize_mxfp8(hidden, probs, routing, LOCAL_START, LOCAL_EXPERTS, valid)
    with pytest.raises(NotImplementedError, match="MXFP8"):
        squared_relu_and_quantize_mxfp8(hidden, torch.zeros(MAX_TOKENS, dtype=torch.int32), valid)
    with pytest.raises(NotImplementedError, match="NVLS symmetric memory"):
        fused_metadata_update(3, torch.zeros(2, dtype=torch.int32), None, torch.zeros(3, dtype=torch.int32))
    fc1, fc2 = _weights()
    with pytest.raises(NotImplementedError, match="MXFP8"):
        mcore_fused_moe(hidden, probs, object(), fc2, ActivationType.SQUARED_RELU, LOCAL_EXPERTS, LOCAL_START, valid,
                        routing)
    with pytest.raises(ValueError, match="num_local_experts"):
        mcore_fused_moe(hidden, probs, fc1[:2], fc2, ActivationType.SQUARED_RELU, LOCAL_EXPERTS, LOCAL_START, valid,
                        routing)
    with pytest.raises(ValueError, match="activation_type"):
        vllm_fused_moe(hidden, probs, fc1, fc2, "swiglu", LOCAL_EXPERTS, LOCAL_START, valid, routing)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused_moe", [mcore_fused_moe, vllm_fused_moe])
def test_fused_moe_bf16_on_cuda_is_close_to_the_fp32_loop(fused_moe):
    """bf16 on CUDA: grouped_mm over 16-row aligned expert blocks (where torch has it) vs the fp32 loop."""
    hidden, probs, routing = _routing(seed=7, hidden_size=16)
    fc1, fc2 = _weights(hidden_size=16, ffn=32)
    valid = torch.tensor([9], dtype=torch.int32)
    expected = _reference_moe(hidden.bfloat16().float(), probs, routing, fc1.bfloat16().float(),
                              fc2.bfloat16().float(), 9)
    got = fused_moe(hidden.cuda().bfloat16(), probs.cuda(), fc1.cuda().bfloat16(), fc2.cuda().bfloat16(),
                    ActivationType.SQUARED_RELU, LOCAL_EXPERTS, LOCAL_START, valid.cuda(), routing.cuda())
    assert_close(got.cpu().float(), expected, rtol=3e-2, atol=3e-2)
