"""Audit ``examples/pretrain_gpt.py``: every curated flag, and every pair of them, either trains or is refused by name.

Not run in CI. On a tiny GPT (2 layers, hidden 64, sequence 32, vocabulary 128, mock data, 2 iterations, CPU, gloo)
each run goes through ``pretrain_gpt.main`` in fresh processes: one per rank, forked from a pool worker that has torch
and the example imported (a start costs milliseconds, not an interpreter and torch import), rendezvoused through a
FileStore (no port). A run gets a wall-clock limit; its rank processes (each in its own process group) are killed past
it. Each run is classified:

* ``ok``: every rank returned 0 and every logged training loss is finite (and the flags' declared effects showed);
* ``refused``: the example's own error path (``run_command``, status 2, or argparse's usage error) with a message
  naming at least one of the flags given, as typed (``--recompute-granularity``; not a library field name);
* ``defect``: anything else -- another exception, a refusal that names none of the flags, a hang, a non-finite loss,
  a flag without the effect it must have (a loss that does not change, a metric not logged, a checkpoint that does
  not resume to the same losses).

Usage::

    .venv/bin/python tools/pretrain_flag_matrix.py                 # singles and pairs, 2 workers
    .venv/bin/python tools/pretrain_flag_matrix.py --only tp2,moe   # these singles and their pair
    .venv/bin/python tools/pretrain_flag_matrix.py --singles-only
    .venv/bin/python tools/pretrain_flag_matrix.py --pairs-with fp8-param   # every single, the pairs with fp8-param

Writes ``<out>/matrix.json`` and ``<out>/matrix.md`` (``--out``, default ``/tmp/pretrain_flag_matrix``).
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import glob
import itertools
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
MAX_RANKS = 4
BASE = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--mock-data", "--vocab-size", "128", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", "2", "--log-interval", "1", "--eval-interval", "2",
        "--eval-iters", "1", "--no-progress")


@dataclass(frozen=True)
class Flag:
    """One curated flag setting: its command-line words, the parallel sizes it needs and the effects it must have.

    ``effects``: ``loss`` (the losses differ from the run without it), ``opt-loss`` (the same, for an optimizer
    setting: not checked beside a flag whose first update is zero), ``lr`` (the logged learning rates differ),
    ``key:NAME`` (the training records log NAME), ``file:GLOB`` (the run writes a file matching GLOB in its
    directory), ``resume`` (the run stops after iteration 1 with ``--exit-interval 1``, saving into ``ckpt/``, and
    a second run resumes from it: together they must give the same losses as the run without the flag).
    ``zero_first_update``: the flag makes the first optimizer step a no-op (warm-up from lr 0).
    """

    name: str
    argv: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...] = ()
    effects: tuple[str, ...] = ()
    zero_first_update: bool = False


def _flag(name: str, words: str, effects: tuple[str, ...] = (), zero_first_update: bool = False,
          **sizes: int) -> Flag:
    return Flag(name, tuple(words.split()), tuple(sorted(sizes.items())), effects, zero_first_update)


FLAGS: tuple[Flag, ...] = (
    # parallel layouts (the world size follows from the sizes)
    _flag("dp2", "--global-batch-size 4", dp=2),
    _flag("tp2", "--tensor-model-parallel-size 2", tp=2),
    _flag("sp", "--tensor-model-parallel-size 2 --sequence-parallel", tp=2),
    _flag("pp2", "--pipeline-model-parallel-size 2", pp=2),
    _flag("vpp", "--pipeline-model-parallel-size 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 1", pp=2),
    _flag("cp2", "--context-parallel-size 2", cp=2),
    _flag("ep2", "--num-experts 4 --expert-model-parallel-size 2 --disable-bias-linear", ("key:load_imbalance",), ep=2),
    _flag("distopt", "--use-distributed-optimizer", dp=2),
    _flag("overlap-grad", "--overlap-grad-reduce", dp=2),
    _flag("overlap-param", "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather", dp=2),
    _flag("fsdp2", "--use-torch-fsdp2 --untie-embeddings-and-output-weights", ("loss",), dp=2),
    # MoE, MTP, MLA
    _flag("moe", "--num-experts 4 --moe-router-topk 2", ("loss", "key:load_imbalance")),
    _flag("moe-nobias", "--num-experts 4 --disable-bias-linear --moe-router-topk 1", ("loss",)),
    _flag("moe-a2a", "--num-experts 4 --moe-token-dispatcher-type alltoall", ("loss",)),
    _flag("moe-gemm", "--num-experts 4 --moe-grouped-gemm", ("loss",)),
    _flag("moe-shared", "--num-experts 4 --moe-shared-expert-intermediate-size 32 --disable-bias-linear "
          "--moe-aux-loss-coeff 0.01",
          ("loss",)),
    _flag("moe-capacity", "--num-experts 4 --moe-expert-capacity-factor 1.0 --moe-router-load-balancing-type aux_loss",
          ("loss",)),
    _flag("mtp", "--mtp-num-layers 1", ("key:mtp_1 loss",)),
    _flag("mla", "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 32 --qk-head-dim 16 "
          "--qk-pos-emb-head-dim 8 --v-head-dim 16 --position-embedding-type rope", ("loss",)),
    # precision
    _flag("bf16", "--bf16", ("loss",)),
    _flag("fp16", "--fp16 --initial-loss-scale 4096", ("loss",)),
    _flag("fp8-tensorwise", "--fp8-format hybrid --fp8-recipe tensorwise", ("loss",)),
    _flag("fp8-delayed", "--fp8-format e4m3 --fp8-recipe delayed --fp8-amax-history-len 4", ("loss",)),
    _flag("precision-aware", "--use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype bf16 "
          "--exp-avg-sq-dtype bf16"),  # bf16 moments move Adam's first two updates below the loss's resolution
    _flag("fp8-param", "--fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather --use-distributed-optimizer",
          ("loss",), dp=2),  # FP8 weights in one-byte buffers, all-gathered from the optimizer's shards
    # recompute, fusions, graphs
    _flag("recompute-full", "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"),
    _flag("recompute-sel", "--recompute-granularity selective --recompute-modules core_attn mlp"),
    _flag("ce-fusion", "--cross-entropy-loss-fusion"),
    _flag("compile", "--compile"),  # each layer and the loss through torch.compile (Inductor on CPU: slow to start)
    _flag("graph-local", "--cuda-graph-impl local"),
    _flag("graph-full", "--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 1"),
    # optimizer and schedule
    _flag("sgd", "--optimizer sgd", ("opt-loss",)),
    _flag("clip", "--clip-grad 0.05"),  # Adam's first update does not depend on the gradient's scale
    _flag("wsd", "--lr-decay-style WSD --lr-wsd-decay-iters 1", ("lr",)),
    _flag("warmup", "--lr-warmup-iters 1 --lr-decay-style linear", ("lr",), zero_first_update=True),
    # model shape
    _flag("qk-ln", "--qk-layernorm", ("loss",)),
    _flag("rope", "--position-embedding-type rope --rotary-percent 0.5", ("loss",)),
    _flag("untie", "--untie-embeddings-and-output-weights", ("loss",)),
    _flag("swiglu-rms", "--swiglu --normalization RMSNorm --disable-bias-linear", ("loss",)),
    _flag("gqa", "--num-query-groups 2", ("loss",)),
    # checkpoints, profiling, timers, housekeeping
    _flag("ckpt", "--save ckpt --save-interval 1", ("resume",)),
    _flag("async-save", "--save ckpt --save-interval 1 --async-save", ("resume",)),
    _flag("profile", "--profile --profile-step-start 1 --profile-step-end 2 --profile-dir prof",
          ("file:prof/trace_rank0_*.json",)),
    _flag("breakdown", "--step-time-breakdown", ("key:fwd-bwd ms",)),
    _flag("manual-gc", "--manual-gc --manual-gc-interval 1"),
)
BY_NAME = {flag.name: flag for flag in FLAGS}


# ----------------------------------------------------------------------------------------------- run layout


def _options(flag: Flag) -> dict[str, tuple[str, ...]]:
    """The flag's words grouped by option: ``{"--save": ("ckpt",), "--bf16": ()}``."""
    options: dict[str, list[str]] = {}
    current = None
    for word in flag.argv:
        if word.startswith("--"):
            current = word
            options[current] = []
        else:
            options[current].append(word)
    return {key: tuple(value) for key, value in options.items()}


def conflict(flags: tuple[Flag, ...]) -> str | None:
    """Why these flags cannot be combined as given (one option with two values), or None."""
    seen: dict[str, tuple[str, ...]] = {}
    for flag in flags:
        for option, values in _options(flag).items():
            if option in seen and seen[option] != values:
                return f"{option} set twice ({' '.join(seen[option])} / {' '.join(values)})"
            seen[option] = values
    return None


def world_size(flags: tuple[Flag, ...]) -> int:
    """Ranks the combined layout needs: tp x pp x cp x dp, with dp grown until the expert layout fits."""
    sizes = {"tp": 1, "pp": 1, "cp": 1, "dp": 1, "ep": 1}
    for flag in flags:
        for key, value in flag.sizes:
            sizes[key] = max(sizes[key], value)
    dp = sizes["dp"]
    # expert ranks (ep x expert-tp, expert-tp defaulting to tp) must divide tp x cp x dp
    while (sizes["tp"] * sizes["cp"] * dp) % (sizes["ep"] * sizes["tp"]):
        dp *= 2
    return sizes["tp"] * sizes["pp"] * sizes["cp"] * dp


def flag_words(flags: tuple[Flag, ...]) -> list[str]:
    """The combined command line of the flags (an option given by both appears once)."""
    words: list[str] = []
    done: set[str] = set()
    for flag in flags:
        for option, values in _options(flag).items():
            if option not in done:
                done.add(option)
                words += [option, *values]
    return words


@dataclass
class Cell:
    """One matrix cell: the flags (one or two), the world size, and where its files go."""

    flags: tuple[Flag, ...]
    world: int
    directory: str
    outcome: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``tp2``, ``tp2+moe``, or the directory's name for a run without flags (``baseline-2``)."""
        return "+".join(flag.name for flag in self.flags) or os.path.basename(self.directory)


# ----------------------------------------------------------------------------------------------- rank processes


def _rank_main(rank: int, world: int, store_path: str, argv: list[str], directory: str, tag: str) -> None:
    """One rank: its own process group (so the launcher can kill what it starts), output into files, then main()."""
    os.setpgid(0, 0)
    os.chdir(directory)
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(f"{tag}rank{rank}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    outcome: dict = {}
    try:
        import torch.distributed as dist

        store = dist.FileStore(store_path, world) if world > 1 else dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=90))
        dist.barrier()  # every pair connected before a rank that refuses its flags can destroy the group
        import pretrain_gpt

        outcome["status"] = pretrain_gpt.main(argv)
    except SystemExit as stop:
        outcome["status"] = stop.code if isinstance(stop.code, int) else 1
    except BaseException as error:  # noqa: BLE001 - every failure is recorded, none stops the audit
        outcome.update(status="exception", type=type(error).__name__, message=" ".join(str(error).split())[:600],
                       traceback=traceback.format_exc()[-3000:])
    with open(f"{tag}rank{rank}.json", "w") as out:
        json.dump(outcome, out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _launch(world: int, argv: list[str], directory: str, tag: str, limit_s: float) -> tuple[list[dict], bool]:
    """Fork ``world`` ranks running ``argv``; per-rank outcomes and whether the wall-clock limit was hit."""
    context = mp.get_context("fork")
    store_path = os.path.join(directory, f"{tag}store")
    procs = [context.Process(target=_rank_main, args=(rank, world, store_path, argv, directory, tag))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + limit_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    timed_out = any(proc.is_alive() for proc in procs)
    for proc in procs:
        if proc.is_alive():
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the rank and anything it started (it leads its group)
            except ProcessLookupError:
                pass
            proc.join(5)
    outcomes = []
    for rank in range(world):
        path = Path(directory, f"{tag}rank{rank}.json")
        outcomes.append(json.loads(path.read_text()) if path.exists() else {"status": "killed"})
    return outcomes, timed_out


def _error_line(directory: str, tag: str, world: int) -> str:
    """The first ``error:`` line any rank printed (the example's and argparse's form)."""
    for rank in range(world):
        path = Path(directory, f"{tag}rank{rank}.err")
        for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
            if ": error: " in line:
                return line.split(": error: ", 1)[1].strip()
    return ""


def run_cell(flags: tuple[Flag, ...], world: int, directory: str, limit_s: float) -> dict:
    """Run one cell in the calling pool worker; its raw outcome (phases, per-rank results, records)."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    words = flag_words(flags)
    resume = any("resume" in flag.effects for flag in flags)
    log = os.path.join(directory, "log.jsonl")
    phases = [("p1-", ["--exit-interval", "1"]), ("p2-", ["--load", "ckpt"])] if resume else [("", [])]
    result: dict = {"phases": []}
    started = time.monotonic()
    for tag, extra in phases:
        argv = [*BASE, *words, *extra, "--log-json", log]
        outcomes, timed_out = _launch(world, argv, directory, tag, limit_s)
        phase = {"tag": tag, "argv": argv, "ranks": outcomes, "timed_out": timed_out,
                 "error_line": _error_line(directory, tag, world)}
        stdout = Path(directory, f"{tag}rank0.out")
        phase["stdout_tail"] = stdout.read_text(errors="replace")[-1500:] if stdout.exists() else ""
        result["phases"].append(phase)
        if timed_out or any(o.get("status") != 0 for o in outcomes):
            break
    result["seconds"] = round(time.monotonic() - started, 2)
    records = []
    if os.path.exists(log):
        records = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    result["train"] = [r for r in records if r.get("kind") == "train"]
    result["valid"] = [r for r in records if r.get("kind") == "valid"]
    result["files"] = sorted(os.path.relpath(p, directory) for p in glob.glob(os.path.join(directory, "**", "*"),
                                                                              recursive=True))[:200]
    return result


def _worker_init() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(EXAMPLES))
    import torch

    torch.set_num_threads(1)
    import pretrain_gpt  # noqa: F401 - imported once here, inherited by every forked rank


# ----------------------------------------------------------------------------------------------- classification


def _names(flags: tuple[Flag, ...]) -> list[str]:
    """The command-line options a refusal of these flags may name: theirs and the base's, as the user typed them
    (a library field name such as ``recompute_granularity`` does not count)."""
    return [option for flag in flags for option in _options(flag)] + [word for word in BASE if word.startswith("--")]


def classify(cell: Cell, raw: dict, singles: dict[str, dict], baselines: dict[int, dict]) -> tuple[str, str]:
    """``(class, reason)`` of a finished cell; ``singles``/``baselines`` hold the single-flag and no-flag results."""
    last = raw["phases"][-1]
    if last["timed_out"]:
        return "defect", f"timeout/hang ({last['tag'] or 'run'}; ranks {[o.get('status') for o in last['ranks']]})"
    statuses = [o.get("status") for o in last["ranks"]]
    errors = [o for o in last["ranks"] if o.get("status") == "exception"]
    if errors:
        return "defect", f"{errors[0]['type']}: {errors[0]['message'][:300]}"
    if any(s not in (0, 2) for s in statuses):
        return "defect", f"exit statuses {statuses}"
    if any(s == 2 for s in statuses):
        line = last["error_line"]
        named = [n for n in _names(cell.flags) if n in line]
        if not all(s == 2 for s in statuses):
            return "defect", f"refused on some ranks only ({statuses}): {line}"
        if last["tag"] == "p2-" and "ckpt" not in line and "--load" not in line:
            return "defect", f"resume refused: {line}"
        return ("refused", line) if named else ("defect", f"refusal names none of the flags: {line}")
    train = raw["train"]
    losses = [r.get("lm loss") for r in train]
    if len(losses) != 2 or not all(isinstance(v, float) and math.isfinite(v) for v in losses):
        return "defect", f"training losses {losses} (expected 2 finite)"
    valid = [r.get("validation loss") for r in raw["valid"]]
    if not all(isinstance(v, float) and math.isfinite(v) for v in valid):
        return "defect", f"validation losses {valid}"
    for flag in cell.flags:
        others = tuple(f for f in cell.flags if f is not flag)
        reference = singles.get(others[0].name) if others else baselines.get(cell.world)
        problem = _missing_effect(flag, raw, reference, cell)
        if problem:
            return "defect", f"{flag.name}: {problem}"
    return "ok", f"losses {[round(v, 5) for v in losses]}"


def _series(raw: dict | None, key: str) -> list | None:
    if not raw or not raw.get("train") or len(raw["train"]) != 2:
        return None
    return [r.get(key) for r in raw["train"]]


def _missing_effect(flag: Flag, raw: dict, reference: dict | None, cell: Cell) -> str | None:
    others = [f for f in cell.flags if f is not flag]
    shared = any(set(_options(flag)) & set(_options(other)) for other in others)  # the reference has it too
    masked = any(other.zero_first_update for other in others)
    resumed = any("resume" in other.effects for other in others)
    for effect in flag.effects:
        if effect in ("loss", "lr", "opt-loss") and (shared or (effect == "opt-loss" and masked)):
            continue
        if effect.startswith("file:") and resumed:  # a window split by the restart records no whole trace
            continue
        if effect in ("loss", "lr", "opt-loss"):
            key = "lr" if effect == "lr" else "lm loss"
            mine, theirs = _series(raw, key), _series(reference, key)
            if theirs is not None and mine == theirs:
                return f"no effect: {key} {mine} equals the run without it"
        elif effect.startswith("key:"):
            if not all(effect[4:] in r for r in raw["train"]):
                return f"no effect: training records lack {effect[4:]!r}"
        elif effect.startswith("file:"):
            if not glob.glob(os.path.join(cell.directory, effect[5:])):
                return f"no effect: no file {effect[5:]}"
        elif effect == "resume":
            if "start at 1" not in raw["phases"][-1]["stdout_tail"]:
                return "the second phase did not resume at iteration 1"
            mine, theirs = _series(raw, "lm loss"), _series(reference, "lm loss")
            if theirs is not None and reference.get("world") == cell.world and not all(
                    abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(mine, theirs)):
                return f"resumed losses {mine} differ from the uninterrupted run's {theirs}"
    return None


# ----------------------------------------------------------------------------------------------- driver


def _submit(pool, cells: list[Cell], limit_s: float) -> dict:
    jobs = {pool.submit(run_cell, cell.flags, cell.world, cell.directory, limit_s): cell for cell in cells}
    done: dict = {}
    for job in futures.as_completed(jobs):
        cell = jobs[job]
        try:
            raw = job.result()
        except Exception as error:  # noqa: BLE001 - the launcher itself failed: record it as a defect
            raw = {"phases": [{"tag": "", "timed_out": False, "ranks": [{"status": "exception",
                   "type": type(error).__name__, "message": str(error)}], "error_line": "", "stdout_tail": ""}],
                   "train": [], "valid": [], "files": []}
        raw["world"] = cell.world
        done[cell.name] = raw
        print(f"  {cell.name:<32} world {cell.world}  {raw.get('seconds', '?')} s", flush=True)
    return done


def build_cells(flags: list[Flag], out: Path, pairs: bool,
                with_names: frozenset[str] = frozenset()) -> tuple[list[Cell], list[Cell], list[dict]]:
    """Singles, pairs and the skipped pairs (too many ranks, or one option given two values); ``with_names``
    (non-empty): only the pairs holding one of these flags."""
    singles = [Cell((f,), world_size((f,)), str(out / "runs" / f.name)) for f in flags]
    cells, skipped = [], []
    for a, b in itertools.combinations(flags, 2) if pairs else ():
        if with_names and not {a.name, b.name} & with_names:
            continue
        why = conflict((a, b))
        world = world_size((a, b))
        if why is None and world > MAX_RANKS:
            why = f"needs {world} ranks"
        if why:
            skipped.append({"cell": f"{a.name}+{b.name}", "why": why})
            continue
        cells.append(Cell((a, b), world, str(out / "runs" / f"{a.name}+{b.name}")))
    return singles, cells, skipped


def write_summary(out: Path, rows: list[dict], skipped: list[dict], seconds: float) -> None:
    """``matrix.json`` and ``matrix.md`` under ``out``."""
    (out / "matrix.json").write_text(json.dumps({"rows": rows, "skipped": skipped, "seconds": seconds}, indent=1))
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["class"]] = counts.get(row["class"], 0) + 1
    lines = ["# pretrain_gpt.py flag matrix", "", f"{len(rows)} runs in {seconds / 60:.1f} min; "
             + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + f"; skipped pairs: {len(skipped)}", ""]
    for kind in ("defect", "refused", "ok"):
        chosen = [r for r in rows if r["class"] == kind]
        lines += [f"## {kind} ({len(chosen)})", "", "| cell | world | reason |", "|---|---|---|"]
        lines += [f"| {r['cell']} | {r['world']} | {r['reason'].replace('|', '/')[:300]} |" for r in chosen]
        lines.append("")
    lines += ["## skipped", ""] + [f"- {s['cell']}: {s['why']}" for s in skipped]
    (out / "matrix.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run the matrix and write its summary; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/pretrain_flag_matrix")
    parser.add_argument("--only", default=None, help="comma-separated flag names (default: all)")
    parser.add_argument("--singles-only", action="store_true")
    parser.add_argument("--pairs-with", default=None,
                        help="comma-separated flag names: only the pairs holding one of them (all singles still run: "
                             "they are the pairs' references)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit-s", type=float, default=60.0, help="wall-clock limit of one run (per phase)")
    opts = parser.parse_args(argv)
    flags = [BY_NAME[name] for name in opts.only.split(",")] if opts.only else list(FLAGS)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with_names = frozenset(opts.pairs_with.split(",")) if opts.pairs_with else frozenset()
    unknown = sorted(with_names - set(BY_NAME))
    if unknown:
        parser.error(f"--pairs-with: unknown flag names {unknown} (known: {', '.join(BY_NAME)})")
    singles, pairs, skipped = build_cells(flags, out, not opts.singles_only, with_names)
    baselines_cells = [Cell((), world, str(out / "runs" / f"baseline-{world}")) for world in (1, 2, 4)]
    context = mp.get_context("spawn")
    with futures.ProcessPoolExecutor(opts.workers, mp_context=context, initializer=_worker_init) as pool:
        print(f"baselines and {len(singles)} singles", flush=True)
        raw = _submit(pool, baselines_cells + singles, opts.limit_s)
        baselines = {cell.world: raw[cell.name] for cell in baselines_cells}
        print(f"{len(pairs)} pairs ({len(skipped)} skipped)", flush=True)
        raw.update(_submit(pool, pairs, opts.limit_s))
    single_raw = {cell.name: raw[cell.name] for cell in singles}
    rows = []
    for cell in singles + pairs:
        kind, reason = classify(cell, raw[cell.name], single_raw, baselines)
        rows.append({"cell": cell.name, "world": cell.world, "class": kind, "reason": reason,
                     "argv": flag_words(cell.flags), "seconds": raw[cell.name].get("seconds"),
                     "ranks": raw[cell.name]["phases"][-1]["ranks"]})
    write_summary(out, rows, skipped, time.monotonic() - started)
    print(f"wrote {out / 'matrix.json'} and {out / 'matrix.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
