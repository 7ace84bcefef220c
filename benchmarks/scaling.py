"""Multi-GPU scaling of ``examples/pretrain_gpt.py``: DP, TP (+SP), PP (1F1B, interleaved), EP, CP, 8B at TP=2.

Each layout runs the training example under ``torchrun`` (one node, rendezvous on 127.0.0.1, a free
port) for a few warm-up and timed steps on mock data, logging every step with ``--step-time-breakdown``.
Every model configuration the selected layouts use is first run on ONE GPU in the same invocation, so
each row is compared with a same-run single-GPU baseline. Printed: a markdown table (layout, GPUs,
step time, tokens/s per GPU, scaling efficiency, MFU, peak memory, compute, exposed communication,
pipeline bubble measured vs theoretical, optimizer); written: ``<out>/scaling.json`` (after every
layout, so a cut-off run keeps what it measured) and each run's log.

Definitions (per GPU, median over the timed steps, averaged over ranks; see
``examples/gpt_training/step_timers.py``):

* tokens/s per GPU = global tokens per step / step time / GPUs; efficiency = that over the baseline's;
* MFU = tokens/s x FLOPs per token / (989e12 x GPUs), FLOPs per token = 6 N + 12 L H Q T (N without
  the input embedding; MoE: active parameters) -- ``examples/gpt_training/metrics.py``;
* compute = forward + backward micro-batch spans (inline TP/SP/CP/EP collectives included);
  ideal compute = the baseline's compute x this GPU's share of the work; exposed comm = grad sync (DP
  reduction not hidden by backward) + (compute - ideal) for tensor/context/expert-parallel layouts;
* bubble = forward-backward - compute - grad sync (pipeline fill/drain and waits for neighbours);
  theoretical: 1F1B (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1), m micro-batches per replica.

Usage (GPU; keep NVLink multicast off)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python benchmarks/scaling.py --gpus 2 --out $OUT              # every 2-GPU layout
    python benchmarks/scaling.py --gpus 2 --layouts llama8b_tp2 --out $OUT
    python benchmarks/scaling.py --gpus 4 --out $OUT              # DP=4, PP=4 (1F1B, interleaved), EP=4
    python benchmarks/scaling.py --device cpu --gpus 2 --layouts tp2_sp --out /tmp/x   # gloo dry run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_monitor import GpuMonitor, describe  # noqa: E402  (a sibling script's module)

SCRIPT = REPO / "examples" / "pretrain_gpt.py"
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class ModelConfig:
    """A model shape for the sweep: flags, micro-batch size, micro-batches per data-parallel replica."""

    flags: list[str]
    mbs: int
    microbatches: int
    seq: int
    layers: int
    baseline: bool = True  # run on one GPU first (False: does not fit on one GPU)


_TINYLLAMA = ["--model-preset", "tinyllama-1.1b", "--vocab-size", "31999"]  # + EOD = 32000, as gpt_full_step
GPU_CONFIGS = {
    "dense": ModelConfig([*_TINYLLAMA], 2, 8, 2048, 22),
    # Mixtral-shaped layers (hidden 2048, GQA 32/8, 8 experts top-2, expert FFN 5632), 8 of them: 2.4 B params.
    "moe": ModelConfig(["--model-preset", "mixtral-tiny", "--num-layers", "8", "--hidden-size", "2048",
                        "--num-attention-heads", "32", "--num-query-groups", "8", "--ffn-hidden-size", "5632",
                        "--moe-ffn-hidden-size", "5632", "--vocab-size", "31999", "--moe-token-dispatcher-type",
                        "alltoall", "--max-position-embeddings", "2048"], 2, 4, 2048, 8),
    "long": ModelConfig([*_TINYLLAMA, "--max-position-embeddings", "16384"], 1, 2, 16384, 22),
    "llama8b": ModelConfig(["--model-preset", "llama-8b", "--vocab-size", "128255",
                            "--max-position-embeddings", "4096"], 1, 8, 4096, 32, baseline=False),
}
_TINY = ["--model-preset", "tiny", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--ffn-hidden-size", "128", "--vocab-size", "255", "--make-vocab-size-divisible-by", "8"]
CPU_CONFIGS = {
    "dense": ModelConfig([*_TINY[:2], "--num-layers", "14", *_TINY[4:]], 2, 4, 64, 14),
    "moe": ModelConfig(["--model-preset", "mixtral-tiny", "--vocab-size", "255", "--make-vocab-size-divisible-by",
                        "8", "--moe-token-dispatcher-type", "alltoall"], 2, 2, 64, 2),
    "long": ModelConfig([*_TINY, "--max-position-embeddings", "256"], 1, 2, 256, 4),
    "llama8b": ModelConfig(["--model-preset", "llama-8b", "--num-layers", "2", "--hidden-size", "64",
                            "--num-attention-heads", "8", "--num-query-groups", "2", "--ffn-hidden-size", "224",
                            "--vocab-size", "511", "--max-position-embeddings", "128"], 1, 2, 128, 2,
                           baseline=False),
}


@dataclass
class Layout:
    """One parallel layout of one model config."""

    config: str
    gpus: int
    flags: list[str] = field(default_factory=list)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vp: int | None = None

    @property
    def dp(self) -> int:
        """Data-parallel size (expert parallelism is carved out of it, as in Megatron)."""
        return self.gpus // (self.tp * self.pp * self.cp)

    def parallel_flags(self, layers: int) -> list[str]:
        """The size flags of this layout for a model of ``layers`` layers."""
        flags = []
        for flag, size in (("--tensor-model-parallel-size", self.tp), ("--pipeline-model-parallel-size", self.pp),
                           ("--context-parallel-size", self.cp), ("--expert-model-parallel-size", self.ep)):
            flags += [flag, str(size)] if size > 1 else []
        if self.pp > 1:
            # The embedding and the output layer + loss count as one layer each of the first and last stage:
            # balances the stages and splits the reference config's 22 layers (24 / 2, / 4, / 8).
            flags += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
        if self.vp:
            flags += ["--num-layers-per-virtual-pipeline-stage", str((layers + 2) // (self.pp * self.vp))]
        return flags


_DDP = ["--overlap-grad-reduce"]
_DISTOPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
_EP = ["--use-distributed-optimizer", "--overlap-grad-reduce"]
LAYOUTS = {
    "dp2_ddp": Layout("dense", 2, _DDP),
    "dp2_distopt": Layout("dense", 2, _DISTOPT),
    "tp2": Layout("dense", 2, ["--use-distributed-optimizer"], tp=2),
    "tp2_sp": Layout("dense", 2, ["--sequence-parallel", "--use-distributed-optimizer"], tp=2),
    "pp2_1f1b": Layout("dense", 2, ["--use-distributed-optimizer"], pp=2),
    "pp2_interleaved": Layout("dense", 2, ["--use-distributed-optimizer"], pp=2, vp=2),
    "ep2": Layout("moe", 2, _EP, ep=2),
    "cp2": Layout("long", 2, ["--cp-comm-type", "a2a", "--use-distributed-optimizer"], cp=2),
    "llama8b_tp2": Layout("llama8b", 2, ["--sequence-parallel", "--use-distributed-optimizer",
                                         "--overlap-grad-reduce"], tp=2),
    "llama8b_tp2_compile": Layout("llama8b", 2, ["--sequence-parallel", "--use-distributed-optimizer",
                                                 "--overlap-grad-reduce", "--compile"], tp=2),
    "dp4_ddp": Layout("dense", 4, _DDP),
    "dp4_distopt": Layout("dense", 4, _DISTOPT),
    "pp4_1f1b": Layout("dense", 4, ["--use-distributed-optimizer"], pp=4),
    "pp4_interleaved": Layout("dense", 4, ["--use-distributed-optimizer"], pp=4, vp=2),
    "pp4_interleaved_no_overlap": Layout("dense", 4, ["--use-distributed-optimizer", "--no-overlap-p2p-communication"],
                                         pp=4, vp=2),
    "ep4": Layout("moe", 4, _EP, ep=4),
}
BASELINE_FLAGS = ["--use-distributed-optimizer"]
# In order of importance (a --budget cut drops the tail): DP efficiency, the 8B MFU, TP, PP, CP, EP.
DEFAULT_2GPU = ["dp2_distopt", "dp2_ddp", "llama8b_tp2", "tp2_sp", "tp2", "pp2_interleaved", "pp2_1f1b", "cp2", "ep2"]
DEFAULT_4GPU = ["dp4_ddp", "dp4_distopt", "pp4_1f1b", "pp4_interleaved", "ep4"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the tests replace this with ``tests/ports.free_port``: race-free slices)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(cpu: bool) -> dict[str, str]:
    """The environment of a torchrun job: our sources first, NVLink multicast off, no GPU in CPU mode."""
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in NVLINK_MULTICAST_OFF.items()}}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1" if cpu else "4")
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.setdefault("NCCL_DEBUG", "INFO")  # the log then names each channel's transport (nccl_transports)
    return env


def nccl_transports(log_text: str) -> list[str]:
    """The NCCL transports of a run's channels (``... via P2P/CUMEM/read``, ``via SHM/direct/direct``), sorted.

    A transport through host memory (SHM, NET) where NVLink peer access (P2P) was expected is the first thing
    to rule out when a data-parallel run scales badly.
    """
    return sorted(set(re.findall(r" via (\S+)", log_text)))


def start_torchrun(nproc: int, flags: list[str], log_json: Path, out_log: Path, cpu: bool,
                   visible_devices: str | None = None) -> subprocess.Popen:
    """Launch ``pretrain_gpt.py`` on ``nproc`` local ranks in its own session; its output goes to ``out_log``."""
    log_json.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT), *flags,
           "--log-json", str(log_json)]
    env = child_env(cpu)
    if visible_devices is not None and not cpu:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    with open(out_log, "w") as handle:
        handle.write("+ " + " ".join(cmd) + "\n")
        handle.flush()
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_torchrun(proc: subprocess.Popen, out_log: Path, deadline: float) -> tuple[int, str]:
    """Wait for a job until ``deadline`` (``time.time()``), killing its session then; (exit code, output tail)."""
    try:
        code = proc.wait(timeout=max(deadline - time.time(), 0.1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun's ranks share its session
        proc.wait()
        code = 124
    return code, out_log.read_text()[-3000:]


def run_torchrun(nproc: int, flags: list[str], log_json: Path, out_log: Path, cpu: bool,
                 timeout: float) -> tuple[int, str]:
    """Run ``pretrain_gpt.py`` on ``nproc`` local ranks; returns (exit code, tail of its output)."""
    proc = start_torchrun(nproc, flags, log_json, out_log, cpu)
    return wait_torchrun(proc, out_log, time.time() + timeout)


def train_records(log_json: Path) -> list[dict]:
    """The ``train`` records of a ``--log-json`` file, by iteration."""
    if not log_json.exists():
        return []
    records = [json.loads(line) for line in log_json.read_text().splitlines() if line.strip()]
    return sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["iteration"])


def common_flags(cfg: ModelConfig, dp: int, iters: int, cpu: bool) -> list[str]:
    """Flags every run of a config shares: batch shape, mock data, per-step logging, no evaluation."""
    flags = [*cfg.flags, "--seq-length", str(cfg.seq), "--micro-batch-size", str(cfg.mbs),
             "--global-batch-size", str(cfg.mbs * cfg.microbatches * dp), "--mock-data", "--train-iters",
             str(iters), "--log-interval", "1", "--eval-interval", "0", "--eval-iters", "1", "--no-progress",
             "--step-time-breakdown", "--seed", "1234", "--no-use-cpu-initialization"]
    return flags if cpu else [*flags, "--bf16"]


def theoretical_bubble(layout: Layout, m: int) -> float | None:
    """Pipeline bubble fraction of the schedule: (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1)."""
    if layout.pp == 1:
        return None
    return (layout.pp - 1) / ((layout.vp or 1) * m + layout.pp - 1)


def llama8b_memory_gb(cfg_flags: list[str], tp: int, dp: int, mbs: int, seq: int, distopt: bool = True) -> dict:
    """Estimated GB per GPU of the 8B config: weights/grads/optimizer by bytes per parameter, activations.

    Parameters per GPU: every matrix split by TP (vocab-parallel embedding and output layer).
    Bytes per parameter: bf16 weight 2 + fp32 gradient buffer 4 + fp32 main weight and Adam moments 12
    (divided by DP with the distributed optimizer). Activations (bf16, with sequence parallelism, per
    token per layer): layer input, both norm outputs, q/k/v, attention output, the residual, fc1's output
    (2 x FFN) and the SwiGLU output, x1.5 for the implementation's temporaries; the fp32 logits and their
    gradient; 5 GB of workspace.
    """
    h, layers, ffn, vocab, heads, groups = 4096, 32, 14336, 128256, 32, 8
    d = h // heads
    per_layer = h * (h + 2 * groups * d) + h * h + 3 * h * ffn + 2 * h
    params = (layers * per_layer + 2 * vocab * h + h) / tp
    states = params * (2 + 4 + 12 / (dp if distopt else 1)) / 1e9
    act_per_token_layer = 2 * (7 * h + 2 * groups * d + 3 * ffn) / tp * 1.5
    activations = act_per_token_layer * mbs * seq * layers / 1e9
    logits = mbs * seq * vocab / tp * 4 * 2 / 1e9
    total = states + activations + logits + 5.0
    return {"params per GPU (B)": params / 1e9, "weights+grads+optimizer GB": states, "activations GB": activations,
            "logits GB": logits, "total GB": total}


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if key in r and r[key] is not None]
    return statistics.median(values) if values else None


def summarize(name: str, layout: Layout, cfg: ModelConfig, records: list[dict], warmup: int) -> dict:
    """Median figures of the timed steps of one run."""
    timed = records[warmup:]
    row = {"layout": name, "config": layout.config, "gpus": layout.gpus, "tp": layout.tp, "pp": layout.pp,
           "vp": layout.vp, "cp": layout.cp, "ep": layout.ep, "dp": layout.dp, "steps": len(timed)}
    for key in ("ms/step", "tokens/s", "MFU %", "mem GB", "max mem GB", "fwd-bwd ms", "compute ms",
                "grad-sync ms", "optimizer ms", "bubble ms", "bubble %"):
        row[key] = _median(timed, key)
    if row["tokens/s"] is not None:
        row["tokens/s/GPU"] = row["tokens/s"] / layout.gpus
    row["theoretical bubble %"] = (100 * theoretical_bubble(layout, cfg.microbatches)
                                   if layout.pp > 1 else None)
    row["losses"] = [r["lm loss"] for r in records]
    return row


def add_comparisons(row: dict, base: dict | None, layout: Layout) -> None:
    """Efficiency against the same-run baseline, ideal compute and exposed communication."""
    if base is None or row.get("tokens/s/GPU") is None or base.get("tokens/s/GPU") is None:
        row["efficiency %"] = None
        row["exposed comm ms"] = row.get("grad-sync ms")
        return
    row["efficiency %"] = 100 * row["tokens/s/GPU"] / base["tokens/s/GPU"]
    # This GPU's share of the baseline's work per step: the global batch is dp times the baseline's.
    share = layout.dp / layout.gpus
    row["ideal compute ms"] = base["compute ms"] * share if base.get("compute ms") is not None else None
    inline = 0.0
    if max(layout.tp, layout.cp, layout.ep) > 1 and row["ideal compute ms"] is not None:
        inline = max(row["compute ms"] - row["ideal compute ms"], 0.0)
    row["inline comm ms"] = inline
    row["exposed comm ms"] = (row["grad-sync ms"] or 0.0) + inline


def add_loaded_efficiency(row: dict, loaded: dict | None) -> None:
    """Efficiency against the baseline run on every GPU at once (``--loaded-baseline``), where there is one."""
    if loaded and not loaded.get("error") and row.get("tokens/s/GPU") and loaded.get("tokens/s/GPU"):
        row["efficiency vs loaded %"] = 100 * row["tokens/s/GPU"] / loaded["tokens/s/GPU"]


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(rows: list[dict]) -> str:
    """The results as a markdown table."""
    head = ("| layout | GPUs | step ms | tokens/s/GPU | eff. vs 1 GPU | eff. vs loaded GPU | MFU | peak GB | "
            "compute ms | exposed comm ms | bubble ms | bubble % (theory) | optimizer ms |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['layout']} | {r['gpus']} | failed: {r['error']} |" + " |" * 10)
            continue
        bubble = "-" if r["pp"] == 1 else f"{_fmt(r['bubble %'])} ({_fmt(r['theoretical bubble %'])})"
        lines.append(
            f"| {r['layout']} | {r['gpus']} | {_fmt(r['ms/step'])} | {_fmt(r.get('tokens/s/GPU'), ',.0f')} | "
            f"{_fmt(r.get('efficiency %'))}{'%' if r.get('efficiency %') is not None else ''} | "
            f"{_fmt(r.get('efficiency vs loaded %'))}{'%' if r.get('efficiency vs loaded %') is not None else ''} | "
            f"{_fmt(r['MFU %'])}{'%' if r['MFU %'] is not None else ''} | {_fmt(r['max mem GB'], '.2f')} | "
            f"{_fmt(r['compute ms'])} | {_fmt(r.get('exposed comm ms'))} | {_fmt(r['bubble ms'])} | {bubble} | "
            f"{_fmt(r['optimizer ms'])} |")
    return "\n".join(lines)


def environment(cpu: bool) -> dict:
    """Device, torch version and date of the run."""
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        if not cpu and torch.cuda.is_available():
            info["device"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        else:
            info["device"] = "cpu (gloo)"
    except ImportError:  # pragma: no cover - torch is a core dependency
        pass
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, help="the default layout list for 2 or 4 GPUs")
    p.add_argument("--layouts", default=None, help=f"comma-separated, from {sorted(LAYOUTS)}")
    p.add_argument("--out", default="scaling_out", help="directory for scaling.json and the run logs")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="cpu: tiny configs on gloo (dry run)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (GPU 2, CPU 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (GPU 5, CPU 1)")
    p.add_argument("--compile", action="store_true", help="pass --compile (layers and loss) to every run")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per run before it is killed")
    p.add_argument("--budget", type=float, default=None, help="skip the remaining runs after this many seconds")
    p.add_argument("--device-memory-gb", type=float, default=139.0,
                   help="per-GPU memory for the 8B fit decision (H200: 139)")
    p.add_argument("--loaded-baseline", action="store_true",
                   help="also run the one-GPU baseline on every GPU at once (independent jobs) and report each "
                        "layout's efficiency against that loaded GPU too")
    p.add_argument("extra", nargs="*", help="further pretrain_gpt.py flags for every run (after --), e.g. "
                   "-- --gradient-accumulation-fusion")
    args = p.parse_args(argv)
    args.cpu = args.device == "cpu"
    args.warmup = args.warmup if args.warmup is not None else (1 if args.cpu else 2)
    args.steps = args.steps if args.steps is not None else (1 if args.cpu else 5)
    names = args.layouts.split(",") if args.layouts else (DEFAULT_4GPU if args.gpus >= 4 else DEFAULT_2GPU)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {sorted(LAYOUTS)}")
    args.names = names
    return args


def llama8b_fit_flags(args: argparse.Namespace, layout: Layout, cfg: ModelConfig) -> list[str]:
    """Print the 8B memory estimate; add full recompute when it would not fit in 85% of the GPU."""
    gpu = GPU_CONFIGS["llama8b"]  # the real shapes, also in a CPU dry run
    est = llama8b_memory_gb(gpu.flags, layout.tp, layout.dp, gpu.mbs, gpu.seq)
    print(f"8B memory estimate per GPU (TP={layout.tp}, DP={layout.dp}, micro-batch {gpu.mbs}, seq {gpu.seq}, "
          "distributed optimizer): " + ", ".join(f"{k} {v:.1f}" for k, v in est.items()), flush=True)
    if args.cpu or est["total GB"] <= 0.85 * args.device_memory_gb:
        print(f"fits in {args.device_memory_gb:.0f} GB without recompute", flush=True)
        return []
    print("does not fit: full recompute of every layer", flush=True)
    return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


def run_flags(args, layout: Layout, cfg: ModelConfig, extra: list[str]) -> list[str]:
    """The ``pretrain_gpt.py`` flags of one run of ``layout``."""
    return [*common_flags(cfg, layout.dp, args.warmup + args.steps, args.cpu), *layout.parallel_flags(cfg.layers),
            *layout.flags, *extra, *(["--compile"] if args.compile else []), *args.extra]


def run_one(args, name: str, layout: Layout, cfg: ModelConfig, extra: list[str], out: Path) -> dict:
    """One torchrun job, summarised."""
    iters = args.warmup + args.steps
    flags = run_flags(args, layout, cfg, extra)
    print(f"== {name}: {layout.gpus} rank(s)", flush=True)
    start = time.time()
    with GpuMonitor(out / f"{name}.gpus.csv", enabled=not args.cpu) as monitor:
        code, tail = run_torchrun(layout.gpus, flags, out / f"{name}.jsonl", out / f"{name}.log", args.cpu,
                                  args.timeout)
    records = train_records(out / f"{name}.jsonl")
    if code != 0 or len(records) < iters:
        print(f"   failed (exit {code}, {len(records)}/{iters} steps logged):\n{tail}", flush=True)
        return {"layout": name, "gpus": layout.gpus, "config": layout.config, "pp": layout.pp,
                "error": f"exit {code}, {len(records)}/{iters} steps", "flags": flags}
    row = summarize(name, layout, cfg, records, args.warmup)
    row["flags"], row["wall s"] = flags, time.time() - start
    row["nccl transports"] = nccl_transports((out / f"{name}.log").read_text(errors="replace"))
    row["gpu clocks"] = monitor.summarize()
    print(f"   {row['ms/step']:.1f} ms/step, {row['tokens/s/GPU']:,.0f} tokens/s/GPU ({row['wall s']:.0f} s)",
          flush=True)
    return row


def run_loaded_baseline(args, config: str, cfg: ModelConfig, copies: int, out: Path) -> dict:
    """The one-GPU baseline run on ``copies`` GPUs at once, as independent jobs (one per GPU, no communication).

    Each job is timed alone; the row holds the mean of their medians (``ms/step``, ``tokens/s/GPU``, ``compute
    ms``) and their range. Set against the plain baseline it shows how much a GPU slows down when the whole node
    is busy (shared power and cooling), which a data-parallel run pays without communicating at all.
    """
    name = f"{config}_1gpu_x{copies}"
    layout = Layout(config, 1, BASELINE_FLAGS)
    iters = args.warmup + args.steps
    flags = run_flags(args, layout, cfg, [])
    print(f"== {name}: {copies} independent one-GPU jobs at once", flush=True)
    start = time.time()
    jobs = []
    with GpuMonitor(out / f"{name}.gpus.csv", enabled=not args.cpu) as monitor:
        for gpu in range(copies):
            log_json, log = out / f"{name}.gpu{gpu}.jsonl", out / f"{name}.gpu{gpu}.log"
            jobs.append((start_torchrun(1, flags, log_json, log, args.cpu, visible_devices=str(gpu)), log_json, log))
        deadline = time.time() + args.timeout
        results = [(wait_torchrun(proc, log, deadline), train_records(log_json)) for proc, log_json, log in jobs]
    failed = [f"gpu{i}: exit {code}, {len(records)}/{iters} steps" for i, ((code, _), records) in enumerate(results)
              if code != 0 or len(records) < iters]
    if failed:
        print(f"   failed: {'; '.join(failed)}", flush=True)
        return {"layout": name, "gpus": copies, "config": config, "pp": 1, "error": "; ".join(failed), "flags": flags}
    per_job = [summarize(name, layout, cfg, records, args.warmup) for (_, records) in results]
    row = {**per_job[0], "layout": name, "gpus": copies, "loaded baseline": True, "flags": flags,
           "wall s": time.time() - start, "gpu clocks": monitor.summarize()}
    for key in ("ms/step", "tokens/s", "tokens/s/GPU", "MFU %", "compute ms", "fwd-bwd ms", "optimizer ms",
                "bubble ms"):
        values = [job[key] for job in per_job if job.get(key) is not None]
        row[key] = statistics.mean(values) if values else None
        if key in ("ms/step", "compute ms") and values:
            row[f"{key} range"] = [min(values), max(values)]
    print(f"   {row['ms/step']:.1f} ms/step per job (range {row['ms/step range'][0]:.1f}-"
          f"{row['ms/step range'][1]:.1f}, {row['wall s']:.0f} s)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = CPU_CONFIGS if args.cpu else GPU_CONFIGS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment(args.cpu), "argv": sys.argv[1:], "rows": []}
    started = time.time()
    baselines: dict[str, dict] = {}
    loaded: dict[str, dict] = {}
    rows: list[dict] = result["rows"]

    def save() -> None:
        (out / "scaling.json").write_text(json.dumps(result, indent=1))

    for name in args.names:
        if args.budget is not None and time.time() - started > args.budget:
            rows.append({"layout": name, "gpus": LAYOUTS[name].gpus, "pp": LAYOUTS[name].pp,
                         "error": "skipped (time budget)"})
            continue
        layout = LAYOUTS[name]
        cfg = configs[layout.config]
        if cfg.baseline and layout.config not in baselines:
            base_layout = Layout(layout.config, 1, BASELINE_FLAGS)
            base = run_one(args, f"{layout.config}_1gpu", base_layout, cfg, [], out)
            base["baseline"] = True
            baselines[layout.config] = base
            rows.append(base)
            save()
        if args.loaded_baseline and cfg.baseline and layout.gpus > 1 and layout.config not in loaded:
            copies = max(LAYOUTS[n].gpus for n in args.names if LAYOUTS[n].config == layout.config)
            loaded[layout.config] = run_loaded_baseline(args, layout.config, cfg, copies, out)
            rows.append(loaded[layout.config])
            save()
        extra = llama8b_fit_flags(args, layout, cfg) if layout.config == "llama8b" else []
        row = run_one(args, name, layout, cfg, extra, out)
        if not row.get("error"):
            base = baselines.get(layout.config)
            add_comparisons(row, None if base is None or base.get("error") else base, layout)
            add_loaded_efficiency(row, loaded.get(layout.config))
        rows.append(row)
        save()
    table = markdown_table(rows)
    env = result["environment"]
    print(f"\n{env.get('device')}, torch {env.get('torch')}, {env['date']}; median of {args.steps} steps after "
          f"{args.warmup} warm-up steps\n\n{table}", flush=True)
    transports = [f"{r['layout']}: {', '.join(r['nccl transports'])}" for r in rows if r.get("nccl transports")]
    if transports:
        print("\nNCCL transports (from NCCL_DEBUG=INFO): " + "; ".join(transports), flush=True)
    clocks = [f"{r['layout']}: {describe(r['gpu clocks'])}" for r in rows if r.get("gpu clocks")]
    if clocks:
        print("\nGPUs while busy (median SM clock and power, max temperature, limiting reasons):\n"
              + "\n".join(clocks), flush=True)
    (out / "scaling.md").write_text(table + "\n")
    save()
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
