"""The paged decode-attention kernel against the gathered reference (GPU; the kernel needs Triton on CUDA)."""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.contexts.paged_attention import (
    paged_decode_attention,
    paged_decode_reference,
    paged_decode_supported,
)


def _case(device: str, dtype: torch.dtype, lengths: list[int], heads: int, groups: int, head_dim: int,
          block_size: int, width: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = len(lengths) * width + 3
    k = torch.randn(num_blocks * block_size, groups, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_blocks * block_size, groups, head_dim, generator=gen).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=gen)[: len(lengths) * width]
    tables = perm.view(len(lengths), width).to(device)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(device, dtype)
    kv_len = torch.tensor(lengths, device=device)
    return q, k, v, tables, kv_len


def test_reference_equals_per_request_attention() -> None:
    q, k, v, tables, kv_len = _case("cpu", torch.float32, [1, 7, 20], heads=4, groups=2, head_dim=8,
                                    block_size=4, width=5)
    got = paged_decode_reference(q, k, v, tables, kv_len, 4)
    for r, n in enumerate(kv_len.tolist()):
        slots = torch.cat([torch.arange(b * 4, b * 4 + 4) for b in tables[r].tolist()])[:n]
        kk = k[slots].repeat_interleave(2, dim=1).transpose(0, 1)  # [heads, n, d]
        vv = v[slots].repeat_interleave(2, dim=1).transpose(0, 1)
        att = torch.softmax(q[r].unsqueeze(1) @ kk.transpose(1, 2) / 8 ** 0.5, dim=-1) @ vv
        torch.testing.assert_close(got[r], att.squeeze(1), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,groups,head_dim,block_size,lengths", [
    (32, 8, 128, 256, [1, 300, 2048, 4097]),
    (16, 16, 64, 16, [5, 64, 65, 1000]),
    (8, 1, 128, 64, [3000]),
])
def test_kernel_matches_gathered_reference(heads, groups, head_dim, block_size, lengths) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    width = -(-max(lengths) // block_size) + 1
    q, k, v, tables, kv_len = _case("cuda", torch.bfloat16, lengths, heads, groups, head_dim, block_size, width)
    assert paged_decode_supported(q, k)
    got = paged_decode_attention(q, k, v, tables, kv_len, block_size)
    want = paged_decode_reference(q.float(), k.float(), v.float(), tables, kv_len, block_size)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_kernel_compiles_without_graph_break() -> None:
    """Under torch.compile the kernel is an opaque custom op: one graph, the eager result exactly."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, k, v, tables, kv_len = _case("cuda", torch.bfloat16, [3, 70, 500], 8, 2, 64, 16, 33)
    compiled = torch.compile(lambda *a: paged_decode_attention(*a, 16) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, tables, kv_len), paged_decode_attention(q, k, v, tables, kv_len, 16) * 2,
                               rtol=0, atol=0)


def test_custom_op_fake_gives_the_output_shape() -> None:
    """The op's fake (meta) implementation, which torch.compile traces with, has the query's shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 8, 64, dtype=torch.bfloat16)
        cache = torch.empty(16 * 40, 2, 64, dtype=torch.bfloat16)
        out = torch.ops.megatron_core.paged_decode_attention(q, cache, cache, torch.zeros(3, 33, dtype=torch.long),
                                                             torch.ones(3, dtype=torch.long), 16, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
