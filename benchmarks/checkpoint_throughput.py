"""Save/load throughput of ``megatron_core.dist_checkpointing`` and training time blocked by a save.

The state is that of a GPT-like model with ``--params`` parameters and mixed-precision Adam:
bf16 weights (2 bytes/param) plus fp32 main params, ``exp_avg`` and ``exp_avg_sq`` (12 bytes/param),
14 bytes per parameter in all, stored as layer-stacked ShardedTensors under Megatron's keys
(``optimizer.state.exp_avg.<key>`` ...). One process, no process group (the single-rank case).

Measured:
- save: ``dist_checkpointing.save`` into a fresh directory, fsync and rename included (GB/s);
- load: ``dist_checkpointing.load`` into fresh buffers (GB/s). The files were just written, so they
  are read from the page cache unless ``--drop-caches`` works (root only);
- blocked: how long the training loop waits for a synchronous save versus an asynchronous one
  (``async_sharded_save=True`` + ``AsyncCallsQueue``: planning and staging the tensors into private CPU
  copies), and how long the background write then takes while a matmul "training" loop runs.

Usage: ``python benchmarks/checkpoint_throughput.py --params 250e6 --dir /tmp/ckpt_bench``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import torch

from megatron_core import dist_checkpointing
from megatron_core.dist_checkpointing import AsyncCallsQueue, ShardedTensor

HIDDEN = 4096


def layer_shapes(num_params: int) -> dict[str, tuple[int, ...]]:
    """Stacked per-layer weights of a hidden-4096 GPT (qkv, proj, fc1, fc2) plus an embedding."""
    per_layer = {"self_attention.linear_qkv.weight": (3 * HIDDEN, HIDDEN),
                 "self_attention.linear_proj.weight": (HIDDEN, HIDDEN),
                 "mlp.linear_fc1.weight": (4 * HIDDEN, HIDDEN),
                 "mlp.linear_fc2.weight": (HIDDEN, 4 * HIDDEN)}
    embedding = 32000 * HIDDEN
    layer_params = sum(a * b for a, b in per_layer.values())
    num_layers = max(1, round((num_params - embedding) / layer_params))
    shapes = {f"decoder.layers.{k}": (num_layers, *v) for k, v in per_layer.items()}
    shapes["embedding.word_embeddings.weight"] = (32000, HIDDEN)
    return shapes


def make_state(shapes: dict[str, tuple[int, ...]], fill: bool, main_params: bool = True) -> dict:
    """Sharded state dict: bf16 weights and fp32 optimizer states (random when ``fill``, else empty)."""
    state: dict = {"iteration": 1}
    parts = [("", torch.bfloat16), ("optimizer.state.exp_avg.", torch.float32),
             ("optimizer.state.exp_avg_sq.", torch.float32)]
    if main_params:
        parts.append(("optimizer.state.fp32_param.", torch.float32))
    for key, shape in shapes.items():
        for prefix, dtype in parts:
            t = torch.empty(shape, dtype=dtype)
            if fill:
                t.normal_()
            state[prefix + key] = ShardedTensor.from_rank_offsets(prefix + key, t)
    return state


def state_bytes(state: dict) -> int:
    """Bytes of tensor data in a sharded state dict."""
    return sum(v.data.numel() * v.data.element_size() for v in state.values() if isinstance(v, ShardedTensor))


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (needs root); ``True`` when it worked."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def fake_training(seconds: float) -> int:
    """Matmuls for ``seconds`` (the work an async save overlaps with); returns the step count."""
    a = torch.randn(512, 512)
    steps, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)
        steps += 1
    return steps


def measure_async(state: dict, root: Path) -> tuple[float, float]:
    """``(seconds training is blocked, seconds the background write takes)`` of an async save."""
    queue = AsyncCallsQueue()
    os.sync()  # no write-back of the previous save competes with this one
    t0 = time.perf_counter()
    request = dist_checkpointing.save(state, root / "async", async_sharded_save=True)
    queue.schedule_async_request(request)
    blocked = time.perf_counter() - t0
    t1 = time.perf_counter()
    steps = 0
    while queue.get_num_unfinalized_calls():
        steps += fake_training(0.2)
        queue.maybe_finalize_async_calls(blocking=False)
    background = time.perf_counter() - t1
    queue.close()
    print(f"async save: training blocked {blocked:.2f} s (plan + stage copies), written in the background "
          f"in {background:.2f} s while {steps} training matmuls ran")
    shutil.rmtree(root / "async", ignore_errors=True)
    return blocked, background


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e9, help="model parameters (default 1e9)")
    parser.add_argument("--dir", default="/tmp/mcore_ckpt_bench", help="scratch directory (removed afterwards)")
    parser.add_argument("--drop-caches", action="store_true", help="drop the page cache before loading (root)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--no-main-params", action="store_true",
                        help="leave out the fp32 main params (10 bytes/param instead of 14)")
    parser.add_argument("--skip-async", action="store_true",
                        help="no async save (it stages a second copy of the whole state in memory)")
    args = parser.parse_args()

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shapes = layer_shapes(int(args.params))
    num_params = sum(torch.Size(s).numel() for s in shapes.values())
    torch.manual_seed(0)
    state = make_state(shapes, fill=True, main_params=not args.no_main_params)
    total = state_bytes(state)
    gb = total / 1e9
    print(f"{num_params / 1e6:.0f}M params, {gb:.2f} GB of weights + optimizer state, "
          f"{len(state) - 1} tensors, torch {torch.__version__}, {os.cpu_count()} CPUs")

    os.sync()
    t0 = time.perf_counter()
    dist_checkpointing.save(state, root / "sync")
    sync_save = time.perf_counter() - t0
    print(f"sync save: {sync_save:.2f} s = {gb / sync_save:.2f} GB/s (training blocked {sync_save:.2f} s)")

    async_blocked = async_background = float("nan")
    if not args.skip_async:
        async_blocked, async_background = measure_async(state, root)
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"
    expected = state[key].data[0, :4].clone()
    del state
    gc.collect()

    cache_dropped = drop_caches() if args.drop_caches else False
    empty = make_state(shapes, fill=False, main_params=not args.no_main_params)
    t0 = time.perf_counter()
    loaded = dist_checkpointing.load(empty, root / "sync")
    load_time = time.perf_counter() - t0
    print(f"load: {load_time:.2f} s = {gb / load_time:.2f} GB/s ({'cold' if cache_dropped else 'page cache warm'})")
    assert torch.equal(loaded[key][0, :4], expected)
    results = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": platform.machine(), "cpus": os.cpu_count(),
        "params": num_params, "bytes": total, "sync_save_s": sync_save, "save_GBps": gb / sync_save,
        "load_s": load_time, "load_GBps": gb / load_time, "load_cold": cache_dropped,
        "async_blocked_s": async_blocked, "async_background_s": async_background, "sync_blocked_s": sync_save,
        "disk_usage": subprocess.run(["du", "-sh", str(root / "sync")], capture_output=True, text=True).stdout.split()[0],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
