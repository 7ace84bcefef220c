"""The sync-free aligned row layout of the grouped-GEMM experts (``align_expert_rows``)."""

import torch

from megatron_core.transformer.moe.grouped_linear import (
    GROUPED_MM_ROW_ALIGN,
    align_expert_rows,
    grouped_gemm,
    unpad_expert_rows,
)


def test_layout_places_each_group_at_an_aligned_start_and_keeps_order() -> None:
    counts = torch.tensor([5, 0, 17, 16, 3])
    layout = align_expert_rows(counts, int(counts.sum()))
    ends = layout.ends.tolist()
    assert layout.total_rows % GROUPED_MM_ROW_ALIGN == 0
    assert layout.total_rows >= int(counts.sum()) + len(counts) * (GROUPED_MM_ROW_ALIGN - 1)
    assert ends[-1] == layout.total_rows and layout.counts.sum().item() == layout.total_rows
    starts = [0, *ends[:-1]]
    assert all(s % GROUPED_MM_ROW_ALIGN == 0 for s in starts)
    index, row = layout.index.tolist(), 0
    for e, c in enumerate(counts.tolist()):
        assert index[row:row + c] == list(range(starts[e], starts[e] + c))
        assert starts[e] + c <= ends[e]
        row += c
    assert len(set(index)) == len(index)


def test_grouped_gemm_on_the_aligned_layout_equals_the_unpadded_one() -> None:
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 9, 20])
    x = torch.randn(int(counts.sum()), 8)
    w = torch.randn(4, 6, 8)
    expected = grouped_gemm(x, w, counts.tolist())
    layout = align_expert_rows(counts, x.shape[0])
    padded = x.new_zeros(layout.total_rows, 8).index_copy(0, layout.index, x)
    got = grouped_gemm(padded, w, layout).index_select(0, layout.index)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_unpad_expert_rows_gradient_is_the_scatter_of_index_select():
    gen = torch.Generator().manual_seed(0)
    padded = torch.randn(10, 3, generator=gen, requires_grad=True)
    index = torch.tensor([0, 1, 2, 4, 5, 8])  # distinct rows; 3, 6, 7, 9 are padding
    grad = torch.randn(6, 3, generator=gen)
    out = unpad_expert_rows(padded, index)
    out.backward(grad)
    reference = padded.detach().clone().requires_grad_(True)
    want = reference.index_select(0, index)
    want.backward(grad)
    assert torch.equal(out, want) and torch.equal(padded.grad, reference.grad)
