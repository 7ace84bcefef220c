"""Time and peak memory of HF -> distributed checkpoint (TP=2) -> HF for a 1.1B Llama on CPU.

The model is the BENCHMARK.md reference shape (22 layers, hidden 2048, 32 heads, 4 query groups,
FFN 5632, vocab 32000, untied) with random bf16 weights, saved by transformers with small shards.
Each conversion runs as its own ``megatron-convert`` process; its peak resident memory is the
kernel's ``ru_maxrss`` for that process (``os.wait4``), compared with the largest input shard.
The round trip is checked bitwise, tensor by tensor.

    PYTHONPATH=src python benchmarks/hf_conversion.py --work /tmp/hfbench [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import torch

REFERENCE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 tie_word_embeddings=False)
TINY = dict(REFERENCE, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2)


def make_model(path: str, shape: dict, shard: str) -> None:
    """Random bf16 Llama saved with ``save_pretrained`` (run in a child process, so its memory is not measured)."""
    code = (
        "import torch, transformers, json, sys\n"
        "cfg = transformers.LlamaConfig(**json.loads(sys.argv[1]))\n"
        "torch.manual_seed(0)\n"
        "m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)\n"
        "m.save_pretrained(sys.argv[2], max_shard_size=sys.argv[3])\n"
    )
    subprocess.run([sys.executable, "-c", code, json.dumps(shape), path, shard], check=True)


def run_measured(argv: list[str]) -> tuple[float, int]:
    """Run ``megatron-convert argv`` in a child; return (seconds, peak RSS bytes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "megatron_core.models.hf.cli", *argv, "--no-progress"], env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"megatron-convert {argv[0]} failed with status {proc.returncode}")
    return seconds, usage.ru_maxrss * 1024


def compare(a: str, b: str) -> int:
    """Check every tensor of HF dirs ``a`` and ``b`` is bitwise equal; returns the tensor count."""
    from megatron_core.models.hf import HFCheckpointReader

    ra, rb = HFCheckpointReader(a), HFCheckpointReader(b)
    assert ra.names() == rb.names(), sorted(set(ra.names()) ^ set(rb.names()))
    for name in ra.names():
        x, y = ra.read(name), rb.read(name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    return len(ra.names())


def main() -> None:
    """Build the model once, convert both ways, print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", required=True, help="scratch directory (about 3x the model size on disk)")
    parser.add_argument("--shard-size", default="500MB")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a small model, for a quick check of the script")
    args = parser.parse_args()
    hf, ckpt, back = (os.path.join(args.work, n) for n in ("hf", "ckpt", "back"))
    if not os.path.isfile(os.path.join(hf, "config.json")):
        make_model(hf, TINY if args.tiny else REFERENCE, args.shard_size)
    for d in (ckpt, back):
        shutil.rmtree(d, ignore_errors=True)
    shards = [os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf) if f.endswith(".safetensors")]
    t1, rss1 = run_measured(["hf-to-mcore", "--hf", hf, "--out", ckpt, "--tp", str(args.tp)])
    t2, rss2 = run_measured(["mcore-to-hf", "--mcore", ckpt, "--out", back, "--max-shard-size", args.shard_size])
    count = compare(hf, back)
    largest = max(shards)
    total = sum(shards)
    rows = [(f"hf -> mcore (TP={args.tp})", t1, rss1), ("mcore -> hf", t2, rss2)]
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; {count} tensors, {total / 1e9:.2f} GB in {len(shards)} shards, "
          f"largest {largest / 1e6:.0f} MB; round trip bitwise identical\n")
    print("| step | time (s) | peak RSS (MB) | peak RSS / largest shard |")
    print("|---|---|---|---|")
    for name, seconds, rss in rows:
        print(f"| {name} | {seconds:.1f} | {rss / 1e6:.0f} | {rss / largest:.2f} |")
    worst = max(rss1, rss2) / largest
    print(f"\nworst ratio {worst:.2f} ({'below' if worst < 1.5 else 'ABOVE'} the 1.5 target)")


if __name__ == "__main__":
    main()
