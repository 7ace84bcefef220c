"""The NVFP4 packed parameter layout of DDP's buffers (Megatron-Core 0.19's ``nvfp4_packed_param_index_map``).

An NVFP4 parameter spans half its elements in the parameter buffer (two 4-bit values per byte) and all of
them in the gradient buffer. Without Transformer Engine no tensor is NVFP4, so, as Megatron-LM's own test
does, a stand-in predicate marks chosen bf16 parameters as NVFP4 and a stand-in storage swap records the
byte view each receives; the layout, the buffers and the all-gather are this library's own code. Expected
values are worked out by hand in the comments.
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron_core.distributed import DistributedDataParallelConfig
from megatron_core.distributed import param_and_grad_buffer as pgb
from megatron_core.distributed.param_layout import (
    compute_nvfp4_packed_layout,
    compute_per_buffer_param_layout,
)
from megatron_core.fp4_utils import (
    get_nvfp4_rowwise_packed_shape,
    is_grouped_nvfp4tensor,
    is_nvfp4tensor,
    modify_grouped_nvfp4_rowwise_storage,
    modify_nvfp4_rowwise_storage,
)
from megatron_core.optimizer import DistributedOptimizer, OptimizerConfig
from tests.dist_harness import run_on_ranks


def _params(*shapes: tuple[int, ...]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(shape, dtype=torch.bfloat16)) for shape in shapes]


@contextmanager
def _as_nvfp4(nvfp4: list[torch.nn.Parameter]):
    """Treat ``nvfp4`` as NVFP4 parameters in the buffer module; each gets its packed byte view as ``.rowwise``."""
    def swap(param, view):
        param.rowwise = view

    with mock.patch.object(pgb, "is_nvfp4tensor", side_effect=lambda t: any(t is p for p in nvfp4)), \
            mock.patch.object(pgb, "modify_nvfp4_rowwise_storage", side_effect=swap):
        yield


def _buffer(params, nvfp4, *, dist_opt=False, bucket_size=None, group=None):
    config = DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, bucket_size=bucket_size)
    dp = dist.get_world_size(group) if group is not None else 1
    layout = compute_per_buffer_param_layout(params, bucket_size, dp, config) if dist_opt else None
    names = {p: f"p{i}" for i, p in enumerate(params)}
    with _as_nvfp4(nvfp4):
        return pgb._ParamAndGradBuffer(config, torch.uint8 if nvfp4 else torch.bfloat16, torch.bfloat16,
                                       list(names.items()), group, bucket_size, names, 1.0,
                                       param_layout=layout, device=torch.device("cpu"))


# Four parameters (creation order), laid out in reverse: p3, p2 | p1, p0 with buckets of >= 4000 elements.
MULTI_SHAPES = [(64, 64), (100,), (64, 64), (32, 4)]
# Gradient layout (dist-opt): p3 [0, 128); p2 at 128 -> [128, 4224) closes bucket 0 (4224 = 33 * 128, no
# padding); p1 [4224, 4324); p0 at 4352 -> [4352, 8448) closes bucket 1 (8448 = 66 * 128).
MULTI_GRAD = {3: (0, 128, 0), 2: (128, 4224, 0), 1: (4224, 4324, 1), 0: (4352, 8448, 1)}
# Packed: p3 [0, 64); p2 at 64 -> [64, 2112); bucket 0 closes at 2112, padded to 2176 (17 * 128); p1 (bf16,
# full span) [2176, 2276); p0 at 2304 -> [2304, 4352), bucket 1 padded to 4352 (34 * 128).
MULTI_PACKED = {3: (0, 64, 0), 2: (64, 2112, 0), 1: (2176, 2276, 1), 0: (2304, 4352, 1)}
MULTI_PACKED_BUCKETS = [(0, 2176), (2176, 4352)]


def test_packed_layout_mixed_params_without_padding():
    w1, ln, w2 = _params((100, 100), (100,), (10, 20))
    grad = pgb._compute_default_per_buffer_param_layout([w1, ln, w2], None)
    assert grad.param_index_map == {w2: (0, 200, 0), ln: (200, 300, 0), w1: (300, 10300, 0)}
    packed = compute_nvfp4_packed_layout(grad, [w1, ln, w2], [w1, w2])
    # w2 half of 200, the layernorm weight its full 100, w1 half of 10000.
    assert packed.param_index_map == {w2: (0, 100, 0), ln: (100, 200, 0), w1: (200, 5200, 0)}
    assert packed.bucket_indices == [(0, 5200)] and packed.per_bucket_numel_unpadded == [5200]


def test_packed_layout_multiple_buckets_without_padding():
    params = _params(*MULTI_SHAPES)
    grad = pgb._compute_default_per_buffer_param_layout(params, 4000)
    # Unpadded: p3 [0, 128), p2 [128, 4224) closes bucket 0; p1 [4224, 4324), p0 [4324, 8420).
    assert grad.bucket_indices == [(0, 4224), (4224, 8420)]
    packed = compute_nvfp4_packed_layout(grad, params, [params[0], params[2], params[3]])
    assert {i: packed.param_index_map[p] for i, p in enumerate(params)} == {
        3: (0, 64, 0), 2: (64, 2112, 0), 1: (2112, 2212, 1), 0: (2212, 4260, 1)}
    assert packed.bucket_indices == [(0, 2112), (2112, 4260)]


@pytest.mark.parametrize("dp", [2, 4])
def test_packed_layout_distributed_optimizer_padding(dp):
    params = _params(*MULTI_SHAPES)
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=4000)
    grad = compute_per_buffer_param_layout(params, 4000, dp, config)
    assert {i: grad.param_index_map[p] for i, p in enumerate(params)} == MULTI_GRAD
    packed = compute_nvfp4_packed_layout(grad, params, [params[0], params[2], params[3]], dp)
    assert {i: packed.param_index_map[p] for i, p in enumerate(params)} == MULTI_PACKED
    assert packed.bucket_indices == MULTI_PACKED_BUCKETS
    # Bucket 0's unpadded extent ends where bucket 1's first parameter would start (Megatron-Core's rule).
    assert packed.per_bucket_numel_unpadded == [2112, 2176]
    assert all(end % dp == 0 for _, end in packed.bucket_indices)


def test_packed_layout_padding_for_high_nccl_busbw():
    (w,) = _params((10, 20))
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, pad_buckets_for_high_nccl_busbw=True)
    grad = compute_per_buffer_param_layout([w], None, 2, config)
    packed = compute_nvfp4_packed_layout(grad, [w], [w], 2, pad_for_high_nccl_busbw=True)
    assert grad.bucket_indices == [(0, 2**16)] and packed.bucket_indices == [(0, 2**16)]
    assert packed.param_index_map[w] == (0, 100, 0)


def test_odd_nvfp4_numel_is_refused():
    (w,) = _params((3, 5))
    grad = pgb._compute_default_per_buffer_param_layout([w], None)
    with pytest.raises(ValueError, match=r"shape \(3, 5\) has an odd element count \(15\)"):
        compute_nvfp4_packed_layout(grad, [w], [w])


def test_buffer_without_nvfp4_has_no_packed_layout():
    params = _params((100, 100), (100,))
    buffer = _buffer(params, [])
    assert not buffer.has_nvfp4_params
    assert buffer.nvfp4_packed_param_index_map is None and buffer.nvfp4_packed_numel is None
    assert buffer.param_index_map == {params[1]: (0, 100, 0), params[0]: (100, 10100, 0)}


def test_buffer_mixed_params_without_distributed_optimizer():
    params = _params(*MULTI_SHAPES)
    buffer = _buffer(params, [params[0], params[2], params[3]], bucket_size=4000)
    assert buffer.has_nvfp4_params and buffer.param_data is None
    assert [b.param_data for b in buffer.buckets] == [None, None]
    # As test_packed_layout_multiple_buckets_without_padding: the gradient map is the unpadded layout.
    assert buffer.bucket_indices == [(0, 4224), (4224, 8420)]
    assert {i: buffer.nvfp4_packed_param_index_map[p] for i, p in enumerate(params)} == {
        3: (0, 64, 0), 2: (64, 2112, 0), 1: (2112, 2212, 1), 0: (2212, 4260, 1)}
    assert (buffer.nvfp4_packed_numel, buffer.nvfp4_packed_numel_unpadded) == (4260, 4260)
    for bucket in buffer.buckets:  # bucket-local offsets stay in the gradient (full-count) index space
        for param in bucket.params_list:
            start, end, _ = buffer.param_index_map[param]
            assert bucket.param_to_index[param] == (start - bucket.offset, end - bucket.offset)
            assert param.main_grad.data_ptr() == buffer.grad_data[start:].data_ptr()


# All three parameters NVFP4, buckets of >= 4000 elements: reverse order p2 (32 x 4), p1, p0 (64 x 64 each).
# Gradient layout: p2 [0, 128); p1 at 128 -> [128, 4224) closes bucket 0; p0 [4224, 8320) closes bucket 1
# (8320 = 65 * 128). Packed: p2 [0, 64); p1 at 64 -> [64, 2112); bucket 0 padded to 2176 (17 * 128); p0
# [2176, 4224) in bucket 1 (4224 = 33 * 128).
NVFP4_SHAPES = [(64, 64), (64, 64), (32, 4)]
NVFP4_GRAD = [(4224, 8320, 1), (128, 4224, 0), (0, 128, 0)]
NVFP4_PACKED = [(2176, 4224, 1), (64, 2112, 0), (0, 64, 0)]
NVFP4_PACKED_BUCKETS = [(0, 2176), (2176, 4224)]


def test_buffer_distributed_optimizer_single_rank():
    params = _params(*NVFP4_SHAPES)
    buffer = _buffer(params, params, dist_opt=True, bucket_size=4000)
    assert [buffer.param_index_map[p] for p in params] == NVFP4_GRAD
    assert [buffer.nvfp4_packed_param_index_map[p] for p in params] == NVFP4_PACKED
    assert buffer.nvfp4_packed_bucket_indices == NVFP4_PACKED_BUCKETS
    assert (buffer.numel, buffer.nvfp4_packed_numel, buffer.nvfp4_packed_numel_unpadded) == (8320, 4224, 4160)
    assert buffer.param_data.numel() == 4224 and buffer.param_data.dtype == torch.uint8
    for bucket, (start, end) in zip(buffer.buckets, NVFP4_PACKED_BUCKETS):
        assert bucket.param_data.data_ptr() == buffer.param_data[start:].data_ptr()
        assert bucket.param_data.numel() == end - start
    for param, (start, _, _), (packed_start, _, _) in zip(params, NVFP4_GRAD, NVFP4_PACKED):
        assert param.main_grad.shape == param.shape
        assert param.main_grad.data_ptr() == buffer.grad_data[start:].data_ptr()
        assert param.rowwise.shape == get_nvfp4_rowwise_packed_shape(param.shape)  # last dimension halved
        assert param.rowwise.data_ptr() == buffer.param_data[packed_start:].data_ptr()


def test_plain_parameter_in_an_nvfp4_buffer_is_refused():
    w, b = _params((4, 4), (4,))
    with pytest.raises(ValueError, match=r"p1 of dtype torch.bfloat16 cannot be stored in a torch.uint8"):
        _buffer([w, b], [w], dist_opt=True)


def _packed_gather_on_ranks(bucket_size: int) -> dict:
    """On every rank: an NVFP4 buffer over WORLD; fill this rank's shard of each bucket's packed bytes with
    ``rank + 1``, all-gather, and report the layout and what each shard holds afterwards."""
    params = _params(*NVFP4_SHAPES)
    buffer = _buffer(params, params, dist_opt=True, bucket_size=bucket_size, group=dist.group.WORLD)
    dp, rank = dist.get_world_size(), dist.get_rank()
    for bucket in buffer.buckets:
        pgb.shard_buffer(bucket.param_data, dp)[rank].fill_(rank + 1)
    for group in pgb.partition_buckets([buffer]):
        group.start_param_sync(force_sync=False)
    shards = [[int(s.unique().item()) for s in pgb.shard_buffer(b.param_data, dp)] for b in buffer.buckets]
    rowwise_ok = all(p.rowwise.data_ptr() == buffer.param_data[buffer.nvfp4_packed_param_index_map[p][0]:]
                     .data_ptr() for p in params)
    return {"packed": [buffer.nvfp4_packed_param_index_map[p] for p in params],
            "buckets": buffer.nvfp4_packed_bucket_indices, "shards": shards, "rowwise_ok": rowwise_ok}


@pytest.mark.parametrize("dp", [2, 4])
def test_packed_buffer_all_gathers_bytes_across_ranks(dp):
    results = run_on_ranks(dp, _packed_gather_on_ranks, 4000)
    expected = {"packed": NVFP4_PACKED, "buckets": NVFP4_PACKED_BUCKETS,
                "shards": [list(range(1, dp + 1))] * 2, "rowwise_ok": True}
    assert results == [expected] * dp


def test_group_params_for_buffers_puts_nvfp4_in_a_uint8_buffer():
    w, b = _params((4, 4), (4,))
    with _as_nvfp4([w]):
        groups = pgb.group_params_for_buffers([w, b], grad_reduce_in_fp32=True)
    assert {key.param_dtype: plist for key, (plist, _) in groups.items()} == {torch.uint8: [w], torch.bfloat16: [b]}
    assert {key.grad_dtype for key in groups} == {torch.float}


def test_distributed_optimizer_refuses_nvfp4_buffers():
    (w,) = _params((4, 4))
    buffer = _buffer([w], [w], dist_opt=True)
    chunk = mock.Mock(ddp_config=buffer.ddp_config)
    with pytest.raises(ValueError, match="NVFP4 parameters"):
        DistributedOptimizer(torch.optim.Adam([w]), OptimizerConfig(lr=1e-3), None, lambda _: None, [chunk],
                             {0: [buffer]}, None)


def test_fp4_utils_without_transformer_engine():
    t = torch.zeros(4, 6, dtype=torch.bfloat16)
    assert not is_nvfp4tensor(t) and not is_grouped_nvfp4tensor(t)
    assert get_nvfp4_rowwise_packed_shape(torch.Size([4, 6])) == torch.Size([4, 3])
    assert get_nvfp4_rowwise_packed_shape(torch.Size([])) == torch.Size([])
    with pytest.raises(ValueError, match=r"last dimension of shape \(4, 5\) \(5\) must be even"):
        get_nvfp4_rowwise_packed_shape((4, 5))
    with pytest.raises(ValueError, match="expects a Transformer Engine NVFP4Tensor, got Tensor"):
        modify_nvfp4_rowwise_storage(t, torch.zeros(12, dtype=torch.uint8))


class _FakeNVFP4Tensor:
    """Stands for Transformer Engine's ``NVFP4Tensor``: its row-wise bytes are ``_rowwise_data``."""

    def __init__(self, rowwise: torch.Tensor) -> None:
        self._rowwise_data = rowwise


class _FakeGroupedTensor:
    """Stands for Transformer Engine's ``GroupedTensor`` of NVFP4 members (the attributes read here)."""

    def __init__(self, rowwise: torch.Tensor) -> None:
        self.rowwise_data = rowwise
        self.quantizer = SimpleNamespace(_get_compatible_recipe=lambda: SimpleNamespace(nvfp4=lambda: True))
        self.quantized_tensors = None

    def split_into_quantized_tensors(self) -> list[torch.Tensor]:
        return list(self.rowwise_data.view(2, -1).unbind(0))


def test_fp4_utils_swap_stand_in_transformer_engine_bytes(monkeypatch):
    for name, cls in (("nvfp4_tensor", "NVFP4Tensor"), ("grouped_tensor", "GroupedTensor")):
        module = types.ModuleType(f"transformer_engine.pytorch.tensor.{name}")
        setattr(module, cls, _FakeNVFP4Tensor if cls == "NVFP4Tensor" else _FakeGroupedTensor)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    plain = _FakeNVFP4Tensor(torch.arange(8, dtype=torch.uint8).view(2, 4))
    assert is_nvfp4tensor(plain) and not is_grouped_nvfp4tensor(plain)
    buffer = torch.zeros(12, dtype=torch.uint8)
    modify_nvfp4_rowwise_storage(plain, buffer[4:].view(2, 4))
    assert buffer.tolist() == [0] * 4 + list(range(8)) and plain._rowwise_data.data_ptr() == buffer[4:].data_ptr()
    with pytest.raises(ValueError, match="new storage has 6 bytes, the row-wise data 8"):
        modify_nvfp4_rowwise_storage(plain, buffer[:6])

    grouped = _FakeGroupedTensor(torch.arange(8, dtype=torch.uint8))
    assert is_grouped_nvfp4tensor(grouped) and not is_nvfp4tensor(grouped)
    modify_grouped_nvfp4_rowwise_storage(grouped, buffer[:8].view(2, 4))
    assert buffer[:8].tolist() == list(range(8)) and grouped.rowwise_data.data_ptr() == buffer.data_ptr()
    assert [m.tolist() for m in grouped.quantized_tensors] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="must be uint8"):
        modify_grouped_nvfp4_rowwise_storage(grouped, torch.zeros(8))
