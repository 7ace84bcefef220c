"""List the places where a training step makes the host wait for the GPU (CUDA only).

Runs ``examples/pretrain_gpt.py`` in this process under ``torch.cuda.set_sync_debug_mode("warn")``,
which warns on every synchronising operation (``.item()``, a blocking copy, ``nonzero`` ...), and
prints each distinct call stack with the number of times it synchronised. Stacks that repeat once per
step or per micro-batch are the ones that cost time: each drains the GPU's queue, and the GPU then
idles while the host prepares the next kernels. Logging is set to every ``--log-interval`` steps so
that its (wanted) synchronisations stand apart.

    PYTHONPATH=src:. python3 benchmarks/host_syncs.py -- --model-preset tinyllama-1.1b --bf16 \\
        --global-batch-size 16
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
import warnings
from pathlib import Path

import torch
from gpt_full_step import pretrain_flags  # the flags every benchmark run of pretrain_gpt.py shares

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    """Run the training script with synchronisation warnings and print the synchronising stacks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--min-count", type=int, default=3, help="print stacks that synchronised this often")
    parser.add_argument("extra", nargs="*", help="pretrain_gpt.py flags (after --)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: synchronisation warnings exist only there")
    sys.path.insert(0, str(REPO / "examples"))
    import pretrain_gpt

    counts: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message).lower():
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        counts["".join(traceback.format_list(frames[-8:]))] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    argv = [*pretrain_flags(args.iterations, args.iterations), *args.extra]
    try:
        pretrain_gpt.main(argv)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for stack, count in counts.most_common():
        if count >= args.min_count:
            print(f"=== {count} synchronisations at\n{stack}", flush=True)
    print(f"RESULT {sum(counts.values())} synchronisations in {args.iterations} iterations, "
          f"{sum(c for c in counts.values() if c >= args.min_count)} at stacks seen {args.min_count}+ times")


if __name__ == "__main__":
    main()
