"""Gather-only permutation for top-k routing (``permute_top_k`` / ``unpermute_top_k``) equals the scatter-add path."""

from __future__ import annotations

import pytest
import torch

from megatron_core.transformer.moe.token_permutation import permute, permute_top_k, unpermute, unpermute_top_k


def _routing(num_tokens: int, num_experts: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(num_tokens, num_experts, generator=gen)
    top = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.zeros(num_tokens, num_experts).scatter_(1, top, scores.softmax(-1).gather(1, top))
    return routing_map, probs


@pytest.mark.parametrize("topk", [1, 2, 3])
def test_top_k_permutation_matches_values_and_gradients(topk):
    num_tokens, num_experts, hidden = 37, 8, 5
    routing_map, probs = _routing(num_tokens, num_experts, topk, seed=topk)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weight = torch.randn(num_tokens * topk, hidden, generator=gen)  # a different factor per row: an "expert"
    results = []
    for gather_only in (False, True):
        tokens = x.clone().requires_grad_(True)
        p = probs.clone().requires_grad_(True)
        if gather_only:
            rows, row_probs, sorted_indices, token_rows = permute_top_k(tokens, routing_map, topk, probs=p)
            out = unpermute_top_k(rows * weight * row_probs.unsqueeze(-1), sorted_indices, token_rows)
        else:
            rows, row_probs, sorted_indices = permute(tokens, routing_map, probs=p, num_out_tokens=num_tokens * topk)
            out = unpermute(rows * weight * row_probs.unsqueeze(-1), sorted_indices, restore_shape=x.shape)
        out.pow(2).sum().backward()
        results.append((rows.detach(), sorted_indices, out.detach(), tokens.grad, p.grad))
    for name, a, b in zip(("rows", "sorted_indices", "output", "grad tokens", "grad probs"), *results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def test_token_rows_list_each_tokens_rows_in_expert_order():
    routing_map = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    rows, _, sorted_indices, token_rows = permute_top_k(torch.arange(3.0).unsqueeze(-1), routing_map, 2)
    # rows by expert: e0 <- tokens 0, 2; e1 <- tokens 1, 2; e2 <- tokens 0, 1
    assert sorted_indices.tolist() == [0, 2, 1, 2, 0, 1]
    assert token_rows.tolist() == [[0, 4], [2, 5], [1, 3]]
    assert rows.view(-1).tolist() == [0.0, 2.0, 1.0, 2.0, 0.0, 1.0]


@pytest.mark.parametrize("keep", ["all", "fewer"])
def test_counted_rows_equal_the_nonzero_order_for_any_routing(keep):
    # Any number of experts per token (0 to all): with the row count given, rows come from counting; without it,
    # from nonzero() (a device-to-host sync). Both give expert-major rows, each expert's tokens in token order.
    gen = torch.Generator().manual_seed(3)
    routing_map = torch.rand(41, 6, generator=gen) < 0.35
    tokens = torch.randn(41, 4, generator=gen)
    probs = torch.rand(41, 6, generator=gen) * routing_map
    want_rows, want_probs, want_indices = permute(tokens, routing_map, probs=probs)
    count = want_indices.numel() if keep == "all" else want_indices.numel() - 5
    rows, row_probs, sorted_indices = permute(tokens, routing_map, probs=probs, num_out_tokens=count)
    assert torch.equal(sorted_indices, want_indices[:count])
    assert torch.equal(rows, want_rows[:count]) and torch.equal(row_probs, want_probs[:count])


@pytest.mark.parametrize("alignment", [1, 4, 16])
def test_aligned_permutation_places_the_same_rows_at_aligned_group_starts(alignment):
    from megatron_core.transformer.moe.token_permutation import permute_top_k_aligned

    num_tokens, num_experts, hidden, topk = 29, 5, 3, 2
    routing_map, probs = _routing(num_tokens, num_experts, topk, seed=11)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, hidden, generator=gen)
    counts = routing_map.sum(dim=0)
    results = []
    for aligned in (False, True):
        tokens = x.clone().requires_grad_(True)
        p = probs.clone().requires_grad_(True)
        if aligned:
            rows, row_probs, sorted_indices, token_rows, layout = permute_top_k_aligned(
                tokens, routing_map, topk, alignment, probs=p)
            ends = layout.ends.tolist()
            starts = [0] + ends[:-1]
            assert all(s % alignment == 0 for s in starts) and ends[-1] == layout.total_rows == rows.shape[0]
            assert layout.counts.tolist() == [e - s for s, e in zip(starts, ends)]
            keep = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts.tolist())])
            padding = torch.ones(rows.shape[0], dtype=torch.bool).index_fill_(0, keep, False)
            assert not rows[padding].any() and not row_probs[padding].any()
            assert (sorted_indices[padding] == num_tokens).all()
        else:
            rows, row_probs, sorted_indices, token_rows = permute_top_k(tokens, routing_map, topk, probs=p)
            keep = torch.arange(rows.shape[0])
        weight = torch.randn(num_tokens * topk, hidden, generator=torch.Generator().manual_seed(2))
        scaled = torch.zeros_like(rows).index_copy(0, keep, weight) if aligned else weight
        out = unpermute_top_k(rows * scaled * row_probs.unsqueeze(-1), sorted_indices, token_rows)
        out.pow(2).sum().backward()
        results.append((rows.detach()[keep], row_probs.detach()[keep], sorted_indices[keep], out.detach(),
                        tokens.grad, p.grad))
    for name, a, b in zip(("rows", "probs", "sorted_indices", "output", "grad tokens", "grad probs"), *results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


def test_fused_flag_gives_the_unfused_permutation():
    """``fused=True`` (Transformer Engine's kernel in Megatron-Core) computes the same rows here."""
    torch.manual_seed(0)
    tokens, probs = torch.randn(6, 4), torch.rand(6, 3)
    routing_map = torch.rand(6, 3) > 0.4
    plain = permute(tokens, routing_map, probs)
    fused = permute(tokens, routing_map, probs, fused=True)
    for a, b in zip(plain, fused):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    back = unpermute(plain[0], plain[2], tokens.shape, probs=probs, routing_map=routing_map)
    torch.testing.assert_close(unpermute(plain[0], plain[2], tokens.shape, probs=probs, routing_map=routing_map,
                                         fused=True), back, rtol=0, atol=0)
