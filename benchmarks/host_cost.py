"""How long the host takes to issue one training step (CUDA), and where that time goes.

Runs ``examples/pretrain_gpt.py`` in this process with the reference's 22 layers at tiny widths (hidden 128,
sequence 128), so that the GPU finishes each kernel long before the host issues the next and a step's time is
the host's: Python, dispatch, guard checks and kernel launches. When this time approaches a real step's GPU
time (about 57 ms per micro-batch on an H100 for the 1.1B reference), the GPU waits for the host. With
``--profile`` the steps after the first log window run under cProfile and the functions with the most own and
cumulative time are printed.

    PYTHONPATH=src:. python3 benchmarks/host_cost.py              # compiled layers, global batch 2
    PYTHONPATH=src:. python3 benchmarks/host_cost.py --profile -- --global-batch-size 16
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from gpt_full_step import pretrain_flags  # the flags every benchmark run of pretrain_gpt.py shares

REPO = Path(__file__).resolve().parent.parent
TINY_WIDTHS = ["--model-preset", "tinyllama-1.1b", "--hidden-size", "128", "--num-attention-heads", "4",
               "--num-query-groups", "2", "--ffn-hidden-size", "256", "--seq-length", "128",
               "--max-position-embeddings", "128", "--vocab-size", "255"]


def main() -> None:
    """Run the training script at tiny widths and print the host time per step (and a profile)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--windows", type=int, default=3, help="timed log windows after the warm-up window")
    parser.add_argument("--no-compile", action="store_true", help="eager layers instead of pretrain_gpt's --compile")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed windows (slows them down)")
    parser.add_argument("extra", nargs="*", help="further pretrain_gpt.py flags (after --)")
    args = parser.parse_args()
    on_cpu = not torch.cuda.is_available()  # runs, but there the kernels' own time counts too
    sys.path.insert(0, str(REPO / "examples"))
    import pretrain_gpt

    from gpt_training import loop

    profiler = cProfile.Profile()
    warmup_steps = args.log_interval
    original_train_step = loop.Trainer.train_step

    def train_step(self, iteration: int):
        profiling = args.profile and iteration > warmup_steps
        if profiling:
            profiler.enable()
        try:
            return original_train_step(self, iteration)
        finally:
            if profiling:
                profiler.disable()

    loop.Trainer.train_step = train_step
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        argv = [*TINY_WIDTHS, *([] if on_cpu else ["--bf16"]),
                *pretrain_flags(args.log_interval * (1 + args.windows), args.log_interval), "--log-json", str(log),
                *([] if args.no_compile else ["--compile"]), *args.extra]
        try:
            pretrain_gpt.main(argv)
        finally:
            loop.Trainer.train_step = original_train_step
        windows = [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "train"][1:]
    if args.profile:
        for key in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(30)
            print(text.getvalue(), flush=True)
    ms = statistics.median(r["ms/step"] for r in windows)
    print(f"RESULT host time per step {ms:.1f} ms (median of {len(windows)} windows of {args.log_interval} steps"
          f"{', under cProfile' if args.profile else ''}{'; CPU: kernels included' if on_cpu else ''})", flush=True)


if __name__ == "__main__":
    main()
