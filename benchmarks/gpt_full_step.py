"""Time the full training step of ``examples/pretrain_gpt.py`` (protocol: shared BENCHMARK.md, "full step").

Runs the pretraining script on the reference configuration (tinyllama-1.1b preset, random tokens, bf16
params, micro-batch 2, Adam with fp32 main weights, distributed optimizer on), one step per log line, and
reports the median of 10 steps after 3 warm-up steps: step time, tokens/s, model TFLOP/s, MFU, peak memory.

    PYTHONPATH=src python3 benchmarks/gpt_full_step.py             # eager
    PYTHONPATH=src python3 benchmarks/gpt_full_step.py --compile   # compiled layers and loss
    python3 benchmarks/gpt_full_step.py --tiny                      # CPU smoke run of the same path

Extra arguments after ``--`` go to ``pretrain_gpt.py`` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = ["--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "256"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="pass --compile to pretrain_gpt.py")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 model for a CPU smoke run")
    parser.add_argument("extra", nargs="*", help="further pretrain_gpt.py flags (after --)")
    args = parser.parse_args()

    model = TINY if args.tiny else ["--model-preset", "tinyllama-1.1b", "--bf16", "--vocab-size", "31999"]  # + EOD = 32000
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        cmd = [sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), *model, "--mock-data",
               "--use-distributed-optimizer", "--micro-batch-size", "2", "--global-batch-size", "2",
               "--train-iters", str(args.warmup + args.steps), "--log-interval", "1", "--eval-interval", "0",
               "--eval-iters", "1", "--no-progress", "--log-json", str(log),
               *(["--compile"] if args.compile else []), *args.extra]
        print("+", " ".join(cmd), flush=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"),
                                                                           os.environ.get("PYTHONPATH")]))}
        subprocess.run(cmd, check=True, env=env)
        records = [json.loads(line) for line in log.read_text().splitlines()]
    train = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["iteration"])
    timed = train[args.warmup:args.warmup + args.steps]
    if len(timed) < args.steps:
        raise SystemExit(f"expected {args.warmup + args.steps} logged steps, got {len(train)}")
    ms = statistics.median(r["ms/step"] for r in timed)
    tokens = statistics.median(r["tokens/s"] for r in timed)
    line = f"full step{' (compiled layers+loss)' if args.compile else ' (eager)'}: {ms:.1f} ms, {tokens:,.0f} tok/s"
    if "MFU %" in timed[0]:
        mfu = statistics.median(r["MFU %"] for r in timed)
        line += f", {mfu * 9.89:.1f} TFLOP/s, MFU {mfu:.1f}%, peak mem {max(r['mem GB'] for r in timed):.2f} GB"
    print("RESULT", line, flush=True)


if __name__ == "__main__":
    main()
