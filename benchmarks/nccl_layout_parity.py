"""Layout parity on NCCL in bf16: 20 training steps of each layout against the single-GPU run.

Section 7 check 6 of the reliability requirements on the GPU machine: for TP=2 with sequence
parallelism, PP=2 (1F1B and interleaved), DP=2, CP=2 and EP=2, ``examples/pretrain_gpt.py`` trains 20 steps from the same
initial weights and the same data as a one-GPU run of the same model, and the loss curves are compared
by relative Frobenius error ``||loss - loss_ref|| / ||loss_ref||`` <= 2e-2 (bf16; the per-step maximum and
the gradient norms' error are printed too). Identical weights: a one-rank run saves the initial model
(``--train-iters 0 --save``) and every run, the reference included, loads it (``--no-load-optim
--no-load-rng``; the checkpoint is resharded to each layout). Exits non-zero when a layout fails or is
out of tolerance.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python benchmarks/nccl_layout_parity.py --out $OUT
    python benchmarks/nccl_layout_parity.py --device cpu --out /tmp/parity    # gloo, fp32, tiny, 3 steps
    python benchmarks/nccl_layout_parity.py --device cpu --bf16 --steps 20 --lr 1e-3 --out /tmp/parity  # gloo, bf16
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scaling import environment, run_torchrun, train_records  # noqa: E402

TOLERANCE = 2e-2  # relative Frobenius error, bf16 (reliability requirements, section 7 item 6)
GPU_MODELS = {
    "dense": ["--model-preset", "tiny", "--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
              "--num-query-groups", "4", "--ffn-hidden-size", "2816", "--seq-length", "1024",
              "--max-position-embeddings", "1024", "--vocab-size", "31999", "--make-vocab-size-divisible-by", "32"],
    "moe": ["--model-preset", "mixtral-tiny", "--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads",
            "16", "--num-query-groups", "4", "--ffn-hidden-size", "2816", "--moe-ffn-hidden-size", "1408",
            "--seq-length", "1024", "--max-position-embeddings", "1024", "--vocab-size", "31999",
            "--moe-token-dispatcher-type", "alltoall"],
}
# Eight layers: four pipeline stages of two virtual stages each.
GPU_MODELS["dense8"] = [*GPU_MODELS["dense"][:2], "--num-layers", "8", *GPU_MODELS["dense"][4:]]
# Vocabularies (plus the EOD token) that pad to the same size at TP=1, 2 and 4 (the padding multiple is
# --make-vocab-size-divisible-by x TP), so the one-rank initial checkpoint loads into every layout.
CPU_MODELS = {
    "dense": ["--model-preset", "tiny", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
              "--ffn-hidden-size", "64", "--seq-length", "32", "--max-position-embeddings", "32",
              "--vocab-size", "207", "--make-vocab-size-divisible-by", "4"],
    "moe": ["--model-preset", "mixtral-tiny", "--seq-length", "32", "--vocab-size", "207",
            "--make-vocab-size-divisible-by", "4", "--moe-token-dispatcher-type", "alltoall"],
}
CPU_MODELS["dense8"] = [*CPU_MODELS["dense"][:2], "--num-layers", "8", *CPU_MODELS["dense"][4:]]
# name: (model, ranks, flags)
LAYOUTS = {
    "tp2_sp": ("dense", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": ("dense", 2, ["--pipeline-model-parallel-size", "2"]),
    "pp2_vp2": ("dense", 2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    "dp2": ("dense", 2, ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
    "cp2": ("dense", 2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    "ep2": ("moe", 2, ["--expert-model-parallel-size", "2"]),
    "dp4": ("dense", 4, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]),
    "tp4_sp": ("dense", 4, ["--tensor-model-parallel-size", "4", "--sequence-parallel"]),
    "tp2_pp2": ("dense", 4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                             "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]),
    "pp4": ("dense", 4, ["--pipeline-model-parallel-size", "4"]),
    "pp4_vp2": ("dense8", 4, ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage",
                              "1"]),
    "cp4": ("dense", 4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a"]),
    "ep4": ("moe", 4, ["--expert-model-parallel-size", "4"]),
}
DEFAULT_2GPU = [name for name, (_, ranks, _) in LAYOUTS.items() if ranks == 2]
DEFAULT_4GPU = [name for name, (_, ranks, _) in LAYOUTS.items() if ranks == 4]


def relative_error(values: list[float], reference: list[float]) -> float:
    """``||values - reference||_2 / ||reference||_2`` (inf when lengths differ or a value is not finite)."""
    if len(values) != len(reference) or not all(math.isfinite(v) for v in values):
        return math.inf
    diff = math.sqrt(sum((a - b) ** 2 for a, b in zip(values, reference)))
    norm = math.sqrt(sum(b * b for b in reference))
    return diff / norm if norm else diff


def _run(args, name: str, nproc: int, flags: list[str], work: Path, out: Path) -> tuple[int, list[dict], str]:
    code, tail = run_torchrun(nproc, flags, work / f"{name}.jsonl", out / f"parity_{name}.log", args.cpu,
                              args.timeout)
    return code, train_records(work / f"{name}.jsonl"), tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, help="the default layout list: the 2- or the 4-rank layouts")
    p.add_argument("--layouts", default=None, help=f"comma-separated, from {list(LAYOUTS)}")
    p.add_argument("--out", default="parity_out")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--steps", type=int, default=None, help="training steps (GPU 20, CPU 3)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--lr", type=float, default=1e-4,
                   help="peak learning rate; at 1e-3 the tiny model's bf16 curves diverge chaotically after Adam's "
                        "first, sign-like updates (step 1 equal, step 2 within 0.3%%, 5%% apart by step 6)")
    p.add_argument("--bf16", action="store_true", help="bf16 on the CPU too (the GPU always runs bf16)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    p.add_argument("--budget", type=float, default=None, help="skip the remaining layouts after this many seconds")
    args = p.parse_args(argv)
    args.cpu = args.device == "cpu"
    steps = args.steps or (3 if args.cpu else 20)
    names = args.layouts.split(",") if args.layouts else (DEFAULT_4GPU if args.gpus >= 4 else DEFAULT_2GPU)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    models = CPU_MODELS if args.cpu else GPU_MODELS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", str(args.lr),
              "--lr-warmup-iters", str(min(5, steps - 1)), "--lr-decay-iters", str(steps), "--log-interval", "1", "--eval-interval",
              "0", "--eval-iters", "1", "--no-progress", "--seed", "1234", *([] if args.cpu and not args.bf16 else ["--bf16"])]
    rows, failed = [], False
    result = {"environment": environment(args.cpu), "steps": steps, "tolerance": args.tolerance, "rows": rows}
    work = Path(tempfile.mkdtemp(prefix="parity_"))
    try:
        references: dict[str, list[dict] | None] = {}
        started = time.time()
        for name in names:
            model, ranks, flags = LAYOUTS[name]
            if args.budget is not None and time.time() - started > args.budget:
                rows.append({"layout": name, "model": model, "passed": False, "error": "skipped (time budget)"})
                failed = True
                continue
            base = [*models[model], *common]
            load = ["--load", str(work / f"init_{model}"), "--no-load-optim", "--no-load-rng"]
            if model not in references:
                start = time.time()
                code, _, tail = _run(args, f"init_{model}", 1, [*base, "--train-iters", "0", "--save",
                                                                str(work / f"init_{model}")], work, out)
                ref_code, ref, ref_tail = (_run(args, f"ref_{model}", 1, [*base, *load, "--train-iters", str(steps)],
                                                work, out) if code == 0 else (code, [], tail))
                ok = ref_code == 0 and len(ref) == steps
                references[model] = ref if ok else None
                print(f"== reference {model} (1 rank): {'ok' if ok else 'FAILED'} ({time.time() - start:.0f} s)"
                      + ("" if ok else f"\n{ref_tail}"), flush=True)
            ref = references[model]
            start = time.time()
            code, records, tail = _run(args, name, ranks, [*base, *load, *flags, "--train-iters", str(steps)],
                                       work, out)
            row = {"layout": name, "model": model, "exit": code, "wall s": round(time.time() - start, 1)}
            if ref is None or code != 0 or len(records) != steps:
                row.update(passed=False, error=f"exit {code}, {len(records)}/{steps} steps, reference "
                                               f"{'ok' if ref is not None else 'failed'}")
                print(f"== {name}: FAILED ({row['error']})\n{tail}", flush=True)
            else:
                losses, ref_losses = [r["lm loss"] for r in records], [r["lm loss"] for r in ref]
                norms, ref_norms = [r["grad norm"] for r in records], [r["grad norm"] for r in ref]
                row.update(
                    loss_rel_err=relative_error(losses, ref_losses),
                    max_step_rel_err=max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                    grad_norm_rel_err=relative_error(norms, ref_norms),
                    first_loss=losses[0], last_loss=losses[-1], ref_last_loss=ref_losses[-1],
                    losses=losses, ref_losses=ref_losses,
                )
                row["passed"] = row["loss_rel_err"] <= args.tolerance
                print(f"== {name}: loss rel. err {row['loss_rel_err']:.2e} ({'ok' if row['passed'] else 'FAIL'})",
                      flush=True)
            failed |= not row["passed"]
            rows.append(row)
            (out / "parity.json").write_text(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    env = result["environment"]
    print(f"\n{env.get('device')}, torch {env.get('torch')}, {env['date']}; {steps} steps, "
          f"{'fp32' if args.cpu and not args.bf16 else 'bf16'}, tolerance {args.tolerance:g} (relative Frobenius error of the losses)\n")
    print("| layout | loss rel. err | max step rel. err | grad-norm rel. err | last loss (ref) | result |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "loss_rel_err" not in r:
            print(f"| {r['layout']} | - | - | - | - | FAILED: {r['error']} |")
            continue
        print(f"| {r['layout']} | {r['loss_rel_err']:.2e} | {r['max_step_rel_err']:.2e} | "
              f"{r['grad_norm_rel_err']:.2e} | {r['last_loss']:.4f} ({r['ref_last_loss']:.4f}) | "
              f"{'pass' if r['passed'] else 'FAIL'} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
