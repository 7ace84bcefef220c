"""Collective bandwidth between the local GPUs (or CPU ranks on gloo): is data parallelism's gradient sync slow
because of the links, or because of us?

Launch one rank per GPU with ``torchrun``::

    python -m torch.distributed.run --nproc-per-node 4 --master-addr 127.0.0.1 benchmarks/nccl_bandwidth.py

Each collective that data parallelism uses (``all_reduce`` for DDP's buckets, ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` for the distributed optimizer) runs on bf16 buffers of several sizes; rank 0 prints
the median time, the algorithm bandwidth (bytes of the full buffer over time) and the bus bandwidth, which
takes out the collective's own traffic factor so that it can be set against a link's speed (``2(n-1)/n`` for an
all-reduce, ``(n-1)/n`` for the other two; the definitions of NVIDIA's nccl-tests). The last lines are
``RESULT`` lines, one per collective at the largest size. With ``NCCL_DEBUG=INFO`` the log also names the
transport of every channel (``via P2P/...`` is NVLink peer access; ``via SHM/...`` goes through host memory).

On CPU (``--device cpu``, gloo, fp32) it runs as a smoke test; gloo lacks the reduce-scatter, which is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                        "NVSHMEM_DISABLE_NVLS": "1"}
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def bus_factor(collective: str, world: int) -> float:
    """nccl-tests' bus-bandwidth factor: how many times the buffer crosses a rank's link, per buffer byte."""
    if collective == "all_reduce":
        return 2 * (world - 1) / world
    return (world - 1) / world


def collective_call(collective: str, buffer: torch.Tensor, world: int) -> Callable[[], None]:
    """A closure running ``collective`` on ``buffer`` (the full-size tensor of the operation)."""
    if collective == "all_reduce":
        return lambda: dist.all_reduce(buffer)
    shard = buffer.new_empty(buffer.numel() // world)
    if collective == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, buffer)
    return lambda: dist.all_gather_into_tensor(buffer, shard)


def synchronize(device: torch.device) -> None:
    """Wait for the device (no-op on CPU, where gloo's calls return when done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_collective(run: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of one call, each call timed alone after a barrier."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def supported(collective: str, backend: str) -> bool:
    """Whether ``backend`` implements ``collective`` (gloo has no reduce-scatter of one tensor)."""
    return not (backend == "gloo" and collective == "reduce_scatter")


def measure(sizes_mb: list[float], device: torch.device, warmup: int, iters: int) -> list[dict]:
    """One row per (collective, size): time, algorithm and bus bandwidth in GB/s."""
    world, backend = dist.get_world_size(), dist.get_backend()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    element = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for collective in COLLECTIVES:
        if not supported(collective, backend):
            continue
        for size_mb in sizes_mb:
            numel = max(world, int(size_mb * 2**20 / element) // world * world)
            buffer = torch.ones(numel, dtype=dtype, device=device)
            seconds = time_collective(collective_call(collective, buffer, world), device, warmup, iters)
            algbw = numel * element / seconds / 1e9
            rows.append({"collective": collective, "MB": numel * element / 2**20, "ms": seconds * 1e3,
                         "algbw GB/s": algbw, "busbw GB/s": algbw * bus_factor(collective, world)})
            del buffer
    return rows


def print_table(rows: list[dict], world: int, backend: str, device: torch.device) -> None:
    """Rank 0's table and the RESULT lines (the largest size of each collective)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{world} ranks, {backend}, {name}, torch {torch.__version__}")
    print(f"{'collective':<16}{'MB':>10}{'ms':>10}{'algbw GB/s':>13}{'busbw GB/s':>13}")
    for row in rows:
        print(f"{row['collective']:<16}{row['MB']:>10.1f}{row['ms']:>10.3f}{row['algbw GB/s']:>13.1f}"
              f"{row['busbw GB/s']:>13.1f}")
    for collective in COLLECTIVES:
        mine = [row for row in rows if row["collective"] == collective]
        if mine:
            top = max(mine, key=lambda row: row["MB"])
            print(f"RESULT {collective} {top['MB']:.0f} MB busbw {top['busbw GB/s']:.1f} GB/s "
                  f"({top['ms']:.3f} ms, {world} ranks)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes-mb", default="8,64,256", help="comma-separated buffer sizes in MiB")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None, help="also write the rows to this file (rank 0)")
    args = p.parse_args(argv)
    for key, value in NVLINK_MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "gpu":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        rows = measure([float(s) for s in args.sizes_mb.split(",")], device, args.warmup, args.iters)
        if dist.get_rank() == 0:
            print_table(rows, dist.get_world_size(), dist.get_backend(), device)
            if args.json:
                with open(args.json, "w") as handle:
                    json.dump(rows, handle, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
