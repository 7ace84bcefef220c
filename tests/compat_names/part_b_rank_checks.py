"""Rank-side checks for tests/compat_names/test_parallel_names_b.py (module level so the rank pool imports them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.inference import communication_utils as comm
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_core.utils import drain_embedding_wgrad_compute

S, B, H, OUT = 4, 2, 6, 8


def reference_data(seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights, input and output gradient shared by the single-process reference and the ranks."""
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(OUT, H, generator=g), "b1": torch.randn(OUT, generator=g),
            "w2": torch.randn(H, OUT, generator=g), "x": torch.randn(S, B, H, generator=g),
            "dy": torch.randn(S, B, H, generator=g)}


def reference_frozen(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Single process: ``y = (x W1^T + b1) W2^T`` with frozen W1, W2 (b1 trainable); output and grads."""
    x = data["x"].clone().requires_grad_(True)
    b1 = data["b1"].clone().requires_grad_(True)
    y = torch.nn.functional.linear(torch.nn.functional.linear(x, data["w1"], b1), data["w2"])
    y.backward(data["dy"])
    return {"y": y.detach(), "dx": x.grad, "db1": b1.grad}


def frozen_tp_check(sequence_parallel: bool) -> dict[str, torch.Tensor]:
    """Column -> Row parallel pair with frozen weights on TP = world size; full output and input grad."""
    tp = dist.group.WORLD
    rank, size = dist.get_rank(tp), dist.get_world_size(tp)
    data = reference_data()
    config = ModelParallelConfig(tensor_model_parallel_size=size, sequence_parallel=sequence_parallel,
                                 perform_initialization=False)
    col = ColumnParallelLinear(H, OUT, config=config, init_method=torch.nn.init.zeros_, bias=True,
                               gather_output=False, tp_group=tp)
    row = RowParallelLinear(OUT, H, config=config, init_method=torch.nn.init.zeros_, bias=False,
                            input_is_parallel=True, skip_bias_add=False, tp_group=tp)
    rows = OUT // size
    with torch.no_grad():
        col.weight.copy_(data["w1"][rank * rows:(rank + 1) * rows])
        col.bias.copy_(data["b1"][rank * rows:(rank + 1) * rows])
        row.weight.copy_(data["w2"][:, rank * rows:(rank + 1) * rows])
    col.weight.requires_grad_(False)
    row.weight.requires_grad_(False)
    s_local = S // size if sequence_parallel else S
    x = data["x"][rank * s_local:(rank + 1) * s_local] if sequence_parallel else data["x"]
    x = x.clone().requires_grad_(True)
    y, _ = row(col(x)[0])
    dy = data["dy"][rank * s_local:(rank + 1) * s_local] if sequence_parallel else data["dy"]
    y.backward(dy)
    bias_grads = [torch.empty_like(col.bias.grad) for _ in range(size)]
    dist.all_gather(bias_grads, col.bias.grad, group=tp)
    if sequence_parallel:
        parts_y = [torch.empty_like(y) for _ in range(size)]
        parts_dx = [torch.empty_like(x.grad) for _ in range(size)]
        dist.all_gather(parts_y, y.detach().contiguous(), group=tp)
        dist.all_gather(parts_dx, x.grad.contiguous(), group=tp)
        y_full, dx_full = torch.cat(parts_y), torch.cat(parts_dx)
    else:
        y_full, dx_full = y.detach(), x.grad
    return {"y": y_full, "dx": dx_full, "db1": torch.cat(bias_grads),
            "weight_grads": [col.weight.grad, row.weight.grad]}


def deferred_wgrad_check(sequence_parallel: bool) -> torch.Tensor:
    """A ColumnParallelLinear with activation / gradient buffers (deferred wgrad) over 2 micro-batches; the
    drained weight gradient of this rank's shard."""
    tp = dist.group.WORLD
    rank, size = dist.get_rank(tp), dist.get_world_size(tp)
    config = ModelParallelConfig(tensor_model_parallel_size=size, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                 sequence_parallel=sequence_parallel, defer_embedding_wgrad_compute=True,
                                 perform_initialization=False)
    activations: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    col = ColumnParallelLinear(H, OUT, config=config, init_method=torch.nn.init.zeros_, bias=False,
                               gather_output=False, tp_group=tp, embedding_activation_buffer=activations,
                               grad_output_buffer=grads)
    data = reference_data()
    rows = OUT // size
    with torch.no_grad():
        col.weight.copy_(data["w1"][rank * rows:(rank + 1) * rows])
    s_local = S // size if sequence_parallel else S
    for mb in range(2):
        x = data["x"] * (mb + 1)
        x = x[rank * s_local:(rank + 1) * s_local] if sequence_parallel else x
        y, _ = col(x)
        y.backward(torch.ones_like(y) * (mb + 1))
    assert col.weight.grad is None and len(activations) == len(grads) == 2
    drain_embedding_wgrad_compute(config, activations, grads, col.weight, tp)
    assert not activations and not grads
    return col.weight.grad


def inference_comm_check() -> dict[str, object]:
    """The communication_utils collectives on the world group and under parallel_state (TP = world size)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    out: dict[str, object] = {}
    src = size - 1
    t = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 if rank == src else None
    out["tensor"] = comm.broadcast_tensor([2, 3], torch.float32, tensor=t, rank=src)
    out["ints"] = comm.broadcast_int_list(3, int_list=[7, 8, 9] if rank == 0 else None, rank=0)
    out["floats"] = comm.broadcast_float_list(2, float_list=[0.5, 1.5] if rank == 0 else None, rank=0)
    out["last"] = comm.broadcast_from_last_pipeline_stage(
        [2], torch.int64, torch.tensor([rank, 42]) if rank == size - 1 else None, world)
    # a ring: every stage sends its rank to the next and receives the previous stage's
    send_buf = torch.tensor([float(rank)])
    recv_buf = torch.empty(1)
    if rank % 2 == 0:
        comm.send_to_next_pipeline_rank(send_buf, world)
        comm.recv_from_prev_pipeline_rank_(recv_buf, world)
    else:
        comm.recv_from_prev_pipeline_rank_(recv_buf, world)
        comm.send_to_next_pipeline_rank(send_buf, world)
    out["prev"] = recv_buf
    out["first"] = comm.is_pipeline_first_stage(world)
    out["is_last"] = comm.is_pipeline_last_stage(world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=size)
    try:
        value = [rank + 100] if rank == parallel_state.get_model_parallel_src_rank() else None
        out["dp_list"] = comm.broadcast_int_list(1, int_list=value, rank=5, data_parallel=True)
        out["first_none"] = comm.is_pipeline_first_stage(None)
    finally:
        parallel_state.destroy_model_parallel()
    return out


def all_ranks_check() -> list[str]:
    """``get_all_ranks()`` on 4 ranks: before set-up, at TP=2 x PP=2, and at DP=2 x EP=2 (MoE groups)."""
    out = [parallel_state.get_all_ranks()]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    try:
        out.append(parallel_state.get_all_ranks())
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        out.append(parallel_state.get_all_ranks())
    finally:
        parallel_state.destroy_model_parallel()
    return out
