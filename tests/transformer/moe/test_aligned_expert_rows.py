"""The sync-free aligned row layout of the grouped-GEMM experts (``align_expert_rows``)."""

import torch

from megatron_core.transformer.moe.grouped_linear import GROUPED_MM_ROW_ALIGN, align_expert_rows, grouped_gemm


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
