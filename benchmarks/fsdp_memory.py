"""Bytes per parameter of persistent training state per rank: DDP + distributed optimizer vs FSDP2, on CPU.

For DP in {1, 2, 4} (gloo ranks on this machine) a small GPT is trained one step under
``DistributedDataParallel`` with the distributed optimizer (bf16 params, fp32 grads, fp32 main
params; with fp32 and with bf16 Adam moments through the precision-aware optimizer) and under
``TorchFullyShardedDataParallel`` (fp32 sharded params, bf16 compute, fp32 sharded grads). Every
rank then adds up the storage it really holds, by category (params, grads, separate main params,
optimizer state; each storage counted once, FSDP DTensors by their local shards), divided by the
model's parameter count. Printed as a markdown table next to the formula (DDP + distopt:
``6 + 12/d``, ``6 + 8/d`` with bf16 moments; FSDP: ``16/d``)::

    PYTHONPATH=src .venv/bin/python benchmarks/fsdp_memory.py

On GPUs (``--device cuda``: one NCCL rank per GPU, DP sizes up to the GPU count) the table adds the
CUDA caching allocator's view: bytes allocated after the step (activations freed) less those before
the model was built, per parameter; ``--preset tinyllama-1.1b`` measures the reference model::

    PYTHONPATH=src python benchmarks/fsdp_memory.py --device cuda --dp 1 2 --preset tinyllama-1.1b
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distopt_memory import run_at_each_dp_size  # the same spawn-per-DP-size driver

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
)
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.transformer import TransformerConfig

PRESETS = {
    "tiny": dict(num_layers=4, hidden_size=128, num_attention_heads=4, vocab=1024, seq=32, batch=4),
    "tiny-llama": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                       vocab=256, seq=32, batch=2, swiglu=True),
    "tinyllama-1.1b": dict(num_layers=22, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                           ffn_hidden_size=5632, vocab=32000, seq=2048, batch=1, swiglu=True),
}
CASES = ("DDP + distributed optimizer", "DDP + distributed optimizer, bf16 moments", "FSDP2 (torch fully_shard)")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards) not yet in ``seen``."""
    total = 0
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def measure(case: str, preset: str, device: torch.device) -> dict[str, float]:
    """One step on this rank, then the bytes per model parameter held in each category."""
    torch.manual_seed(0)
    fsdp = case.startswith("FSDP")
    dtype = torch.float32 if fsdp else torch.bfloat16
    shape = dict(PRESETS[preset])
    vocab, seq, batch, swiglu = shape.pop("vocab"), shape.pop("seq"), shape.pop("batch"), shape.pop("swiglu", False)
    if swiglu:
        shape.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
                     add_bias_linear=False)
    gc.collect()
    allocated_before = 0
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        allocated_before = torch.cuda.memory_allocated(device)
    config = TransformerConfig(**shape, use_cpu_initialization=device.type == "cpu", hidden_dropout=0.0,
                               attention_dropout=0.0, bf16=True, params_dtype=dtype)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab, seq,
                     position_embedding_type="rope" if swiglu else "learned_absolute").to(device=device, dtype=dtype)
    num_params = sum(p.numel() for p in model.parameters())
    if fsdp:
        wrapped = TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(), model)
        opt_config = OptimizerConfig(lr=1e-3, bf16=True)
    else:
        wrapped = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
        moments = torch.bfloat16 if "bf16 moments" in case else torch.float32
        opt_config = OptimizerConfig(lr=1e-3, bf16=True, params_dtype=dtype, use_distributed_optimizer=True,
                                     use_precision_aware_optimizer=moments != torch.float32,
                                     exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    opt = get_megatron_optimizer(opt_config, [wrapped])
    tokens = torch.randint(0, vocab, (batch, seq), device=device)
    positions = torch.arange(seq, device=device).expand(batch, seq)
    wrapped.zero_grad_buffer()
    opt.zero_grad()
    wrapped(tokens, positions, None, labels=tokens).float().mean().backward()
    wrapped.finish_grad_sync()
    assert opt.step()[0]

    seen: set[int] = set()
    params = _storage_bytes(model.parameters(), seen)
    grads = _storage_bytes((p.grad if fsdp else p.main_grad for p in model.parameters()), seen)
    main = _storage_bytes((p for g in opt.optimizer.param_groups for p in g["params"]), seen)
    states = _storage_bytes((t for s in opt.optimizer.state.values() for t in s.values()
                             if isinstance(t, torch.Tensor) and t.dim() > 0), seen)
    result = {k: v / num_params for k, v in
              {"params": params, "grads": grads, "main params": main, "optimizer state": states}.items()}
    if device.type == "cuda":
        del tokens, positions
        gc.collect()
        torch.cuda.synchronize(device)
        result["allocator"] = (torch.cuda.memory_allocated(device) - allocated_before) / num_params
        result["params (count)"] = num_params
    del opt, wrapped, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def formula(case: str, dp: int) -> float:
    """Persistent bytes per parameter on one rank, by construction."""
    if case.startswith("FSDP"):
        return 16 / dp
    return 6 + (8 if "bf16 moments" in case else 12) / dp


def _worker(rank: int, world_size: int, store: str, queue: mp.Queue, preset: str = "tiny",
            device_type: str = "cpu") -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size)
    parallel_state.initialize_model_parallel()
    for case in CASES:
        result = measure(case, preset, device)
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, result)
        if rank == 0:  # the average rank (FSDP shards of small tensors are uneven)
            queue.put((case, world_size, {k: sum(r[k] for r in gathered) / world_size for k in result}))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


CATEGORIES = ("params", "grads", "main params", "optimizer state")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda" and max(args.dp) > torch.cuda.device_count():
        parser.error(f"--dp {max(args.dp)} needs that many GPUs; {torch.cuda.device_count()} visible")
    worker = functools.partial(_worker, preset=args.preset, device_type=args.device)
    rows = run_at_each_dp_size(worker, args.dp)
    rows.sort(key=lambda r: (CASES.index(r[0]), r[1]))
    cuda = args.device == "cuda"
    if cuda:
        print(f"device {torch.cuda.get_device_name()}, preset {args.preset}, "
              f"{rows[0][2]['params (count)'] / 1e9:.3f} B parameters")
    extra = " allocator |" if cuda else ""
    print(f"| layout | DP | params | grads | main params | optimizer state | total | formula |{extra}")
    print("|---|---|---|---|---|---|---|---|" + ("---|" if cuda else ""))
    for case, dp, r in rows:
        total = sum(r[k] for k in CATEGORIES)
        allocator = f" {r['allocator']:.2f} |" if cuda else ""
        print(f"| {case} | {dp} | {r['params']:.2f} | {r['grads']:.2f} | {r['main params']:.2f} | "
              f"{r['optimizer state']:.2f} | {total:.2f} | {formula(case, dp):.2f} |{allocator}")


if __name__ == "__main__":
    main()
