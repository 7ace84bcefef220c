"""One kernel rotates a step's queries and keys and writes the cache (inference/contexts/rope_cache_append.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.contexts.rope_cache_append import (
    rope_cache_append,
    rope_cache_append_reference,
    rope_cache_append_supported,
)
from megatron_core.inference.contexts.rotary import rotate_at_positions


def _case(device, dtype, heads=8, groups=2, head_dim=64, rot=64, tokens=5, slots=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    per_group = heads // groups
    mixed = torch.randn(tokens, 1, groups * (per_group + 2) * head_dim, generator=gen).to(device, dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(64).float(), inv)
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, None, :].to(device)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(device)
    slot_mapping = torch.randperm(slots, generator=gen)[:tokens].to(device)
    caches = [torch.randn(slots, groups, head_dim, generator=gen).to(device, dtype) for _ in range(2)]
    return mixed, angles, positions, slot_mapping, caches, heads


class _Config:
    rotary_interleaved = False


def test_reference_is_the_context_path():
    """The reference equals what the dynamic context does without the kernel: split, rotate, index_copy_."""
    mixed, angles, positions, slots, (k_cache, v_cache), heads = _case("cpu", torch.float32)
    groups, hn = k_cache.shape[1:]
    per_group = heads // groups
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    query = rope_cache_append_reference(mixed, angles, positions, slots, k_ref, v_ref, heads)
    grouped = mixed.view(mixed.shape[0], 1, groups, (per_group + 2) * hn)
    q, k, v = torch.split(grouped, [per_group * hn, hn, hn], dim=3)
    q = q.reshape(mixed.shape[0], 1, heads, hn)
    q, k = rotate_at_positions(q, k, angles, positions, _Config())
    k_cache.index_copy_(0, slots, k[:, 0])
    v_cache.index_copy_(0, slots, v[:, 0])
    torch.testing.assert_close(query, q[:, 0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_ref, k_cache, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v_ref, v_cache, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,groups,head_dim,rot,interleaved", [
    (8, 2, 64, 64, False), (32, 4, 64, 64, False), (4, 4, 128, 64, False), (6, 2, 64, 64, True), (8, 8, 32, 16, True),
])
def test_kernel_matches_reference(heads, groups, head_dim, rot, interleaved):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    mixed, angles, positions, slots, (k_cache, v_cache), heads = _case(
        "cuda", torch.bfloat16, heads=heads, groups=groups, head_dim=head_dim, rot=rot)
    assert rope_cache_append_supported(mixed, angles, k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = rope_cache_append_reference(mixed, angles, positions, slots, k_ref, v_ref, heads, interleaved)
    query = rope_cache_append(mixed, angles, positions, slots, k_cache, v_cache, heads, interleaved)
    torch.testing.assert_close(query, expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(k_cache, k_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0)
    compiled = torch.compile(rope_cache_append, fullgraph=True)
    k2, v2 = k_cache.clone(), v_cache.clone()
    torch.testing.assert_close(compiled(mixed, angles, positions, slots, k2, v2, heads, interleaved), query,
                               rtol=0, atol=0)
    torch.testing.assert_close(k2, k_cache, rtol=0, atol=0)
