"""Time the full training step of ``examples/pretrain_gpt.py`` (protocol: shared BENCHMARK.md, "full step").

Runs the pretraining script on the reference configuration (tinyllama-1.1b preset, random tokens, bf16
params, micro-batch 2, Adam with fp32 main weights, distributed optimizer on), a log line every
``--log-interval`` steps (each log line synchronises the device and reads the loss, grad norm and memory; the
first window, with compilation, is warm-up), and reports the median over the timed windows of each window's
mean step: step time, tokens/s, model TFLOP/s, MFU, peak memory,
and the optimizer's share of the step (``--step-time-breakdown``) next to its bandwidth floor: Adam with
fp32 main params must at least read the fp32 gradient (4 bytes per parameter), read and write the fp32
main param and both moments (24) and write the bf16 param (2), 30 bytes per parameter at the device's
measured copy bandwidth.

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


REFERENCE = ["--model-preset", "tinyllama-1.1b", "--bf16", "--vocab-size", "31999"]  # + EOD = 32000


def pretrain_flags(iterations: int, log_interval: int) -> list[str]:
    """The ``pretrain_gpt.py`` flags every benchmark run shares: random tokens, micro- and global batch 2, the
    distributed optimizer, a log line every ``log_interval`` steps, no evaluation (later flags override these)."""
    return ["--mock-data", "--use-distributed-optimizer", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", str(iterations), "--log-interval", str(log_interval), "--eval-interval", "0",
            "--eval-iters", "1", "--no-progress"]


def run_pretrain(model: list[str], iterations: int, flags: list[str], log_interval: int = 1) -> list[dict]:
    """Run ``pretrain_gpt.py`` (random tokens, micro- and global batch 2, distributed optimizer, a log line every
    ``log_interval`` steps); its training log records in iteration order."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        cmd = [sys.executable, str(REPO / "examples" / "pretrain_gpt.py"), *model,
               *pretrain_flags(iterations, log_interval), "--log-json", str(log), *flags]
        print("+", " ".join(cmd), flush=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"),
                                                                           os.environ.get("PYTHONPATH")]))}
        subprocess.run(cmd, check=True, env=env)
        records = [json.loads(line) for line in log.read_text().splitlines()]
    return sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["iteration"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="pass --compile to pretrain_gpt.py")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (rounded up to whole log windows)")
    parser.add_argument("--log-interval", type=int, default=5,
                        help="steps per log line; the first window is warm-up (1: every step synchronises)")
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 model for a CPU smoke run")
    parser.add_argument("extra", nargs="*", help="further pretrain_gpt.py flags (after --)")
    args = parser.parse_args()

    model = TINY if args.tiny else REFERENCE
    windows = -(-args.steps // args.log_interval)
    warmup = max(1, -(-3 // args.log_interval))  # at least 3 warm-up steps
    train = run_pretrain(model, (warmup + windows) * args.log_interval,
                         ["--step-time-breakdown", *(["--compile"] if args.compile else []), *args.extra],
                         args.log_interval)
    timed = train[warmup:warmup + windows]
    if len(timed) < windows:
        raise SystemExit(f"expected {warmup + windows} log lines, got {len(train)}")
    ms = statistics.median(r["ms/step"] for r in timed)
    tokens = statistics.median(r["tokens/s"] for r in timed)
    line = f"full step{' (compiled layers+loss)' if args.compile else ' (eager)'}: {ms:.1f} ms, {tokens:,.0f} tok/s"
    if "MFU %" in timed[0]:
        mfu = statistics.median(r["MFU %"] for r in timed)
        line += f", {mfu * 9.89:.1f} TFLOP/s, MFU {mfu:.1f}%, peak mem {max(r['mem GB'] for r in timed):.2f} GB"
    print("RESULT", line, flush=True)
    optimizer_ms = statistics.median(r["optimizer ms"] for r in timed if "optimizer ms" in r) if any(
        "optimizer ms" in r for r in timed) else None
    floor_ms = optimizer_floor_ms(args.tiny)
    if optimizer_ms is not None and floor_ms is not None:
        print(f"RESULT optimizer step {optimizer_ms:.2f} ms vs bandwidth floor {floor_ms:.2f} ms "
              f"({optimizer_ms / floor_ms:.2f}x)", flush=True)


ADAM_BYTES_PER_PARAM = 30  # fp32 grad read 4 + fp32 main param, exp_avg, exp_avg_sq read+write 24 + bf16 param write 2


def tinyllama_parameters(layers: int = 22, hidden: int = 2048, kv_width: int = 4 * 64, ffn: int = 5632,
                         vocab: int = 32000) -> int:
    """Parameters of the reference configuration (untied input and output embeddings, SwiGLU, RMSNorm)."""
    per_layer = hidden * (hidden + 2 * kv_width) + hidden * hidden + hidden * 2 * ffn + ffn * hidden + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def optimizer_floor_ms(tiny: bool) -> float | None:
    """Milliseconds Adam needs just to move its bytes once at this device's copy bandwidth (GPU only)."""
    import torch

    if tiny or not torch.cuda.is_available():
        return None
    params = tinyllama_parameters()
    n = 1 << 28
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    bandwidth = 2 * n * 10 / (start.elapsed_time(end) / 1e3)  # bytes read + written per second
    return ADAM_BYTES_PER_PARAM * params / bandwidth * 1e3


if __name__ == "__main__":
    main()
