"""Are training losses unchanged by the fusions? ``examples/pretrain_gpt.py`` with and without them, side by side.

Runs the reference configuration (tinyllama-1.1b preset, bf16, random tokens, micro-batch 2, distributed
optimizer) for ``--steps`` steps three times from the same initial weights and data:

* ``unfused``: eager layers, SwiGLU, the QKV split with RoPE, the loss and the weight-gradient accumulation
  unfused, torch's Adam;
* ``fused``: compiled layers and loss, the fused QKV split + RoPE kernel (on by default),
  ``--cross-entropy-loss-fusion``, ``--gradient-accumulation-fusion`` and the precision-aware optimizer's flat
  fused step (fp32 state, so the same arithmetic as Adam);
* ``unfused, again``: the unfused run once more, same flags and seed: how far two identical bf16 runs drift
  apart (GPU kernels do not promise bit-identical results between processes);
* ``unfused, other seed``: the unfused run from other initial weights (``--seed``), the yardstick for
  what differences mean: the fused run should sit much closer to the unfused one than this does.

It prints the losses every ``--every`` steps and the largest and the mean relative difference to the
unfused run over the last ``--tail`` steps.

    PYTHONPATH=src python3 benchmarks/fusion_loss_curves.py            # GPU, reference config
    PYTHONPATH=src python3 benchmarks/fusion_loss_curves.py --tiny     # CPU smoke run (no compile)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_full_step import REFERENCE, TINY, run_pretrain  # noqa: E402

UNFUSED = ["--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion"]
FUSED = ["--cross-entropy-loss-fusion", "--gradient-accumulation-fusion", "--use-precision-aware-optimizer"]


def run(model: list[str], steps: int, flags: list[str]) -> list[float]:
    """The per-step training losses of one ``pretrain_gpt.py`` run."""
    return [r["lm loss"] for r in run_pretrain(model, steps, ["--lr-warmup-iters", "5", *flags])]


def relative(a: list[float], b: list[float]) -> list[float]:
    """``|a - b| / b`` step by step."""
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--every", type=int, default=5, help="print the losses every this many steps")
    parser.add_argument("--tail", type=int, default=10, help="the differences are summarised over these last steps")
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 model on the CPU, without torch.compile")
    args = parser.parse_args()
    model = TINY if args.tiny else REFERENCE
    compile_flag = [] if args.tiny else ["--compile"]
    runs = {
        "unfused": run(model, args.steps, UNFUSED),
        "fused": run(model, args.steps, [*compile_flag, *FUSED]),
        "unfused, again": run(model, args.steps, UNFUSED),
        "unfused, other seed": run(model, args.steps, [*UNFUSED, "--seed", "4321"]),
    }
    names = list(runs)
    print("\nstep  " + "  ".join(f"{n:>20s}" for n in names))
    for step in range(0, args.steps, args.every):
        print(f"{step + 1:4d}  " + "  ".join(f"{runs[n][step]:20.4f}" for n in names))
    for name in names[1:]:
        diff = relative(runs[name], runs["unfused"])[-args.tail:]
        print(f"RESULT {name} vs unfused over the last {len(diff)} steps: max {max(diff) * 100:.2f}%, "
              f"mean {sum(diff) / len(diff) * 100:.2f}%", flush=True)


if __name__ == "__main__":
    main()
