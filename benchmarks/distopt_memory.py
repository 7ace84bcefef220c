"""Bytes per parameter held by each rank with and without the distributed optimizer (ZeRO-1), on CPU.

For DP in {1, 2, 4} (gloo ranks on this machine) a small GPT is wrapped in
``DistributedDataParallel`` and given an Adam optimizer from ``get_megatron_optimizer``; after one
training step (so Adam's state exists) every rank adds up the storage it really holds, by
category: model params, gradient buffers (``main_grad``), fp32 main params that are separate
from the model params, and optimizer state. Storages are counted once even when several tensors
view them. The result, divided by the model's parameter count, is printed as a markdown table
next to Megatron-Core's formula (bf16 params with fp32 grads: 18 without, ``6 + 12/d`` with the
distributed optimizer; fp32: 16 without, ``8 + 8/d`` with)::

    .venv/bin/python benchmarks/distopt_memory.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_core import parallel_state
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.transformer import TransformerConfig

VOCAB, SEQ, BATCH = 1024, 32, 2
CASES = [  # (label, params dtype, distributed optimizer)
    ("bf16 params, fp32 grads", torch.bfloat16, False),
    ("bf16 params, fp32 grads", torch.bfloat16, True),
    ("fp32 params, fp32 grads", torch.float32, False),
    ("fp32 params, fp32 grads", torch.float32, True),
]


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors`` not already in ``seen`` (which is updated)."""
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def measure(dtype: torch.dtype, distributed_optimizer: bool) -> dict[str, float]:
    """One step on this rank, then the bytes per model parameter held in each category."""
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=4, hidden_size=128, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, bf16=dtype == torch.bfloat16,
                               params_dtype=dtype)
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ).to(dtype)
    num_params = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                                                 use_distributed_optimizer=distributed_optimizer), [ddp])
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(tokens, positions, None, labels=tokens).float().mean().backward()
    ddp.finish_grad_sync()
    assert opt.step()[0]

    seen: set[int] = set()
    params = _storage_bytes(model.parameters(), seen)
    grads = _storage_bytes((p.main_grad for p in model.parameters()), seen)
    main = _storage_bytes((p for g in opt.optimizer.param_groups for p in g["params"]), seen)
    states = _storage_bytes((t for s in opt.optimizer.state.values() for t in s.values()
                             if isinstance(t, torch.Tensor)), seen)
    return {k: v / num_params for k, v in
            {"params": params, "grads": grads, "main params": main, "optimizer state": states}.items()}


def _formula(dtype: torch.dtype, distributed_optimizer: bool, dp: int) -> float:
    if dtype == torch.bfloat16:
        return 6 + 12 / dp if distributed_optimizer else 18.0
    return 8 + 8 / dp if distributed_optimizer else 16.0


def _worker(rank: int, world_size: int, store: str, queue: mp.Queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel()
    for label, dtype, distributed_optimizer in CASES:
        if world_size > 1 and not distributed_optimizer:
            continue  # without sharding every DP rank holds the same as DP=1
        result = measure(dtype, distributed_optimizer)
        if rank == 0:
            queue.put((label, dtype, distributed_optimizer, world_size, result))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def run_at_each_dp_size(worker: Callable[[int, int, str, Any], None], dp_sizes: list[int]) -> list:
    """Spawn ``worker(rank, world_size, store_path, queue)`` on ``dp`` gloo ranks for each size; the queued rows."""
    queue = mp.get_context("spawn").SimpleQueue()
    rows = []
    for dp in dp_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(worker, args=(dp, os.path.join(tmp, "store"), queue), nprocs=dp, start_method="spawn")
        while not queue.empty():
            rows.append(queue.get())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    rows = run_at_each_dp_size(_worker, args.dp)
    rows.sort(key=lambda r: (r[0], r[2], r[3]))
    print("| precision | distributed optimizer | DP | params | grads | main params | optimizer state | total | "
          "Megatron formula |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, dtype, distributed_optimizer, dp, r in rows:
        total = sum(r.values())
        print(f"| {label} | {'yes' if distributed_optimizer else 'no'} | {dp} | {r['params']:.2f} | {r['grads']:.2f} | "
              f"{r['main params']:.2f} | {r['optimizer state']:.2f} | {total:.2f} | "
              f"{_formula(dtype, distributed_optimizer, dp):.2f} |")


if __name__ == "__main__":
    main()
