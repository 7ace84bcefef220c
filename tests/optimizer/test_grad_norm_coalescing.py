"""The gradient norm reads abutting views of one buffer (a DDP buffer's bucket shards) as one tensor.

The norm must not change: the same elements are counted once each, in any list order, with gaps, other
storages, overlapping and non-contiguous views left as they are.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_core.optimizer import clip_grads
from megatron_core.optimizer.clip_grads import get_grad_norm_fp32, grad_norm_tensor


def _reference(tensors: list[torch.Tensor], p: float) -> float:
    return sum(float(t.double().abs().pow(p).sum()) for t in tensors) ** (1.0 / p)


def test_abutting_views_merge_into_one():
    buffer = torch.randn(100)
    shards = [buffer[0:30], buffer[30:70], buffer[70:100]]
    merged = clip_grads._coalesce_adjacent(list(reversed(shards)))
    assert len(merged) == 1
    assert merged[0].data_ptr() == buffer.data_ptr() and merged[0].numel() == 100


def test_gaps_other_storages_and_non_contiguous_views_stay_apart():
    buffer = torch.randn(100)
    other = torch.randn(10)
    matrix = torch.randn(4, 6)
    tensors = [buffer[0:30], buffer[40:70], buffer[70:100], other, matrix, matrix.t()]
    merged = clip_grads._coalesce_adjacent(tensors)
    sizes = sorted(t.numel() for t in merged)
    assert sizes == sorted([30, 60, 10, 24, 24])


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0])
def test_norm_unchanged_by_merging(p):
    buffer = torch.randn(1000)
    tensors = [buffer[500:1000], buffer[0:200], buffer[200:500], torch.randn(7, 3), buffer[10:20]]
    expected = _reference(tensors, p)
    assert math.isclose(get_grad_norm_fp32(tensors, norm_type=p), expected, rel_tol=1e-5)
    assert math.isclose(float(grad_norm_tensor(tensors, norm_type=p)), expected, rel_tol=1e-5)


def test_large_and_small_tensors_both_counted(monkeypatch):
    monkeypatch.setattr(clip_grads, "_ONE_KERNEL_NORM_NUMEL", 64)
    big = torch.randn(256)
    tensors = [big[:128], big[128:], torch.randn(5), torch.randn(3, 3)]
    assert math.isclose(get_grad_norm_fp32(tensors), _reference(tensors, 2.0), rel_tol=1e-5)
