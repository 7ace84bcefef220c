"""``permute`` / ``unpermute``: the gather-only path for k rows per token equals the scatter path.

Values and gradients of a permute -> per-row transform -> unpermute round trip, with top-k routing
(every token exactly k rows), against the general ``index_add_`` path; and a wrong row count is refused.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.transformer.moe.token_permutation import permute, unpermute


def _round_trip(tokens: torch.Tensor, routing_map: torch.Tensor, scale: torch.Tensor, k: int | None):
    x = tokens.clone().requires_grad_()
    n = routing_map.shape[0] * 2
    rows, _, sorted_indices = permute(x, routing_map, num_out_tokens=n, rows_per_token=k)
    out = unpermute(rows * scale[: rows.shape[0], None], sorted_indices, x.shape, rows_per_token=k)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("num_tokens,num_experts", [(7, 4), (32, 8)])
def test_gather_path_equals_scatter_path(num_tokens: int, num_experts: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    tokens = torch.randn(num_tokens, 5, generator=gen, dtype=torch.float64)
    top2 = torch.randn(num_tokens, num_experts, generator=gen).topk(2, dim=-1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, top2, True)
    scale = torch.rand(num_tokens * 2, generator=gen, dtype=torch.float64) + 0.5
    out, grad = _round_trip(tokens, routing_map, scale, 2)
    ref_out, ref_grad = _round_trip(tokens, routing_map, scale, None)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


def test_wrong_row_count_is_refused() -> None:
    with pytest.raises(ValueError, match="not 2 per token"):
        unpermute(torch.zeros(5, 3), torch.arange(5), torch.Size([3, 3]), rows_per_token=2)
