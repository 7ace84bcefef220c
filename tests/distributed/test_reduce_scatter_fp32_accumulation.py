"""``reduce_scatter_with_fp32_accumulation`` and ``DistributedDataParallelConfig.reduce_scatter_with_fp32_accumulation``
on 2 and 4 gloo ranks.

The result must equal an fp32 sum of the same bf16 inputs rounded once to bf16 (exactly), and be closer to
the exact sum than a plain bf16 reduce-scatter. Through DDP with the distributed optimizer, the field must
route the gradient reduce-scatter through it.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.distributed.reduce_scatter_with_fp32_accumulation import (
    reduce_scatter_with_fp32_accumulation,
)
from megatron_core.model_parallel_config import ModelParallelConfig
from tests.dist_harness import run_on_ranks

N = 4096


def _inputs(world: int) -> list[torch.Tensor]:
    """Every rank's bf16 input: large values plus small ones, so bf16 partial sums lose bits."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(N * world, generator=g) * (100.0 if r == 0 else 1.0)).to(torch.bfloat16)
            for r in range(world)]


def _reduce(async_op: bool, op: str) -> tuple:
    world, rank = dist.get_world_size(), dist.get_rank()
    inputs = _inputs(world)
    exact = torch.stack([t.double() for t in inputs]).sum(0).chunk(world)[rank]
    if op == "avg":
        exact = exact / world
    out = torch.empty(N, dtype=torch.bfloat16)
    reduce_op = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
    handle = reduce_scatter_with_fp32_accumulation(out, inputs[rank].clone(), reduce_op, None, async_op)
    if async_op:
        assert handle is not None
        handle.wait(timeout=timedelta(seconds=60))
    else:
        assert handle is None
    fp32_reference = exact.float().to(torch.bfloat16)
    plain = torch.empty(N, dtype=torch.bfloat16)
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(plain, inputs[rank].clone())
    if op == "avg":
        plain = plain / world
    return (torch.equal(out, fp32_reference), (out.double() - exact).abs().sum().item(),
            (plain.double() - exact).abs().sum().item())


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("async_op, op", [(False, "sum"), (True, "sum"), (False, "avg")])
def test_equals_fp32_reduction_and_beats_bf16(world, async_op, op):
    for equal, err_fp32, err_bf16 in run_on_ranks(world, _reduce, async_op, op):
        assert equal
        if world == 4:  # bf16 partial sums only round when more than two terms are added
            assert err_fp32 < err_bf16, (err_fp32, err_bf16)


def test_rejects_bad_arguments():
    out, x = torch.empty(3), torch.empty(7)
    with pytest.raises(ValueError, match="ReduceOp.SUM and ReduceOp.AVG"):
        reduce_scatter_with_fp32_accumulation(out, x, dist.ReduceOp.MAX, None, False)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = ModelParallelConfig()
        self.a = torch.nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)
        self.b = torch.nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)


def _ddp_reduce(fp32_accumulation: bool) -> tuple:
    parallel_state.initialize_model_parallel()
    world, rank = dist.get_world_size(), dist.get_rank()
    ddp = DistributedDataParallel(_Net().config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, reduce_scatter_with_fp32_accumulation=fp32_accumulation,
        grad_reduce_in_fp32=False, bucket_size=2048), _Net())
    buffer = ddp.buffers[0]
    inputs = [t[:buffer.grad_data.numel()] for t in _inputs(world)]
    assert buffer.grad_data.dtype == torch.bfloat16
    buffer.grad_data.copy_(inputs[rank])
    ddp.start_grad_sync()
    ddp.finish_grad_sync()
    # gradients are pre-scaled by 1/world (a power of two: exact in bf16) and summed
    total = torch.stack([t.double() / world for t in inputs]).sum(0)
    matches, shards = [], 0
    for bucket in buffer.buckets:
        start = bucket.offset
        shard = bucket.grad_data.numel() // world
        lo = start + rank * shard
        mine = buffer.grad_data[lo:lo + shard]
        matches.append(torch.equal(mine, total[lo:lo + shard].float().to(torch.bfloat16)))
        shards += 1
    return all(matches), shards


def test_ddp_field_routes_gradient_reduce_scatter():
    results = run_on_ranks(4, _ddp_reduce, True)
    assert all(ok for ok, _ in results) and all(n >= 1 for _, n in results)
    assert not all(ok for ok, _ in run_on_ranks(4, _ddp_reduce, False))


def test_field_rejects_several_optimizer_instances():
    with pytest.raises(ValueError, match="reduce_scatter_with_fp32_accumulation=True is not supported with "
                                         "num_distributed_optimizer_instances"):
        DistributedDataParallelConfig(use_distributed_optimizer=True, num_distributed_optimizer_instances=2,
                                      reduce_scatter_with_fp32_accumulation=True)
