"""The 0.19 parameter-layout API: padding utilities, buffer grouping, default and padded layouts, DDP use."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.distributed.param_and_grad_buffer import (
    _compute_default_per_buffer_param_layout,
    group_params_for_buffers,
)
from megatron_core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron_core.optimizer.param_layout import (
    BufferKey,
    FullParamLayout,
    pad_bucket_end,
    pad_param_start,
    pad_to_divisor,
)
from megatron_core.transformer import TransformerConfig


def _params(*numels: int, dtype: torch.dtype = torch.bfloat16, **attrs) -> list[torch.nn.Parameter]:
    out = []
    for n in numels:
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        for k, v in attrs.items():
            setattr(p, k, v)
        out.append(p)
    return out


def _ddp_config(**kw) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(use_distributed_optimizer=True, **kw)


def test_padding_utilities():
    assert [pad_to_divisor(v, 64) for v in (0, 1, 64, 65)] == [0, 64, 64, 128]
    assert [pad_param_start(v) for v in (0, 63, 65)] == [0, 64, 128]
    assert pad_bucket_end(1, 3, False) == math.lcm(3, 128)
    assert pad_bucket_end(1, 4, True) == 2**16


def test_group_params_for_buffers_keys_and_indices():
    dense = _params(10, 20)
    expert = _params(30, allreduce=False)
    fp32 = _params(5, dtype=torch.float32)
    groups = group_params_for_buffers([dense[0], expert[0], fp32[0], dense[1]], grad_reduce_in_fp32=False)
    assert list(groups) == [BufferKey(torch.bfloat16, torch.bfloat16, False),
                            BufferKey(torch.bfloat16, torch.bfloat16, True),
                            BufferKey(torch.float32, torch.float32, False)]
    assert groups[BufferKey(torch.bfloat16, torch.bfloat16, False)] == (dense, [0, 1])
    assert groups[BufferKey(torch.bfloat16, torch.bfloat16, True)][1] == [0]


def test_default_layout_reverse_order_and_buckets():
    a, b, c = _params(100, 50, 70)
    layout = _compute_default_per_buffer_param_layout([a, b, c], bucket_size=100)
    # reverse order: c [0, 70), b [70, 120) closes bucket 0 (120 >= 100), a [120, 220) closes bucket 1
    assert layout.param_index_map == {c: (0, 70, 0), b: (70, 120, 0), a: (120, 220, 1)}
    assert layout.bucket_indices == [(0, 120), (120, 220)]
    assert layout.per_bucket_numel_unpadded == [120, 100]


def test_padded_layout_alignment_bucket_ends_and_shared_embedding():
    regular = _params(97, 103)
    shared = _params(50, shared_embedding=True)[0]
    layout = DistributedOptimizer._compute_per_buffer_param_layout(
        [shared] + regular, bucket_size=None, data_parallel_world_size=3, ddp_config=_ddp_config())
    # reverse order: 103 at 0, 97 at 128 (64-aligned); bucket 0 is closed at 256, padded to lcm(3, 128) = 384;
    # the shared embedding is alone in bucket 1.
    assert layout.param_index_map[regular[1]] == (0, 103, 0)
    assert layout.param_index_map[regular[0]] == (128, 225, 0)
    assert layout.param_index_map[shared] == (384, 434, 1)
    assert layout.bucket_indices == [(0, 384), (384, 768)]
    assert layout.per_bucket_numel_unpadded == [256, 50]  # closed at the next 64-aligned start, as Megatron
    assert layout.num_optimizer_shards == 3


def test_full_layout_pads_expert_buffers_for_expert_dp():
    dense = _params(1000)
    expert = _params(1000, allreduce=False)
    full = DistributedOptimizer.compute_full_param_layout(dense + expert, None, 3, _ddp_config(),
                                                          expert_data_parallel_world_size=256)
    assert full.layouts[BufferKey(torch.bfloat16, torch.bfloat16, False)].bucket_indices == [(0, 1152)]
    assert full.layouts[BufferKey(torch.bfloat16, torch.bfloat16, True)].bucket_indices == [(0, 1024)]


def test_ddp_uses_given_layout_and_rejects_a_foreign_one(monkeypatch):
    monkeypatch.setattr("megatron_core.distributed.distributed_data_parallel._ddp_groups", lambda pg: (None, None))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    ddp_config = _ddp_config(bucket_size=100)
    params = [p for p in model.parameters()]
    full = DistributedOptimizer.compute_full_param_layout(params, 100, 1, ddp_config)
    ddp = DistributedDataParallel(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1),
                                  ddp_config, model, full_param_layout=full)
    (layout,) = full.layouts.values()
    buffer = ddp.buffers[0]
    assert buffer.param_index_map == layout.param_index_map
    # reverse order: b1 [0, 4), w1 [64, 96), b0 [128, 136) closes bucket 0 (padded to 256), w0 [256, 320)
    assert buffer.bucket_indices == layout.bucket_indices == [(0, 256), (256, 384)]
    for bucket in buffer.buckets:
        for p in bucket.params_list:
            start, end = bucket.param_to_index[p]
            assert (start + bucket.offset, end + bucket.offset) == buffer.param_index_map[p][:2]
    other = FullParamLayout({BufferKey(torch.float32, torch.float32, False): layout})
    with pytest.raises(ValueError, match="full_param_layout"):
        DistributedDataParallel(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1),
                                ddp_config, torch.nn.Linear(8, 8), full_param_layout=other)
