"""The README's main job: train a small GPT end to end on CPU on real text every machine has offline.

1. Collect the Python standard library's source files into a JSONL corpus.
2. Train a byte-level BPE tokenizer on it (``megatron_core.datasets.tokenizers.train_bpe_tokenizer``).
3. Tokenize the corpus into Megatron ``.bin``/``.idx`` files with ``tools/preprocess_data.py``.
4. Train a small GPT with ``examples/pretrain_gpt.py`` (evaluation every 25 steps, a checkpoint at the end),
   then print the validation-loss curve and check that it fell; with matplotlib installed, the train and
   validation loss curves are also drawn into ``loss_curves.png`` beside the logs (its path is printed).

Run from the repository root: ``python examples/main_job.py`` (``--help`` for sizes). Everything is written
under ``--workdir`` (default ``runs/main_job``); a work directory that already holds the job's outputs is refused
(nothing there is changed) unless ``--resume`` continues training from its checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))  # gpt_training (this script may be started from anywhere)

from gpt_training.plots import plot_loss_curves  # noqa: E402
from megatron_core.command_line import UsageError, run_command  # noqa: E402


def collect_corpus(out_path: Path, max_bytes: int) -> int:
    """Write up to ``max_bytes`` of stdlib sources as JSONL documents; return the number of documents."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    written = count = 0
    with out_path.open("w", encoding="utf-8") as out:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            out.write(json.dumps({"text": text}) + "\n")
            written += len(text.encode())
            count += 1
            if written >= max_bytes:
                break
    return count


def run(cmd: list[str]) -> None:
    """Run a step, streaming its output; stop the job if it fails."""
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})


# Everything the job writes under --workdir (and nothing else is ever written, replaced or removed there).
OUTPUTS = ("stdlib.jsonl", "tokenizer", "stdlib_text_document.bin", "stdlib_text_document.idx", "index_cache",
           "checkpoints", "train_log.jsonl", "loss_curves.png")
WARMUP_ITERS = 20


def existing_outputs(work: Path) -> list[str]:
    """The job's outputs already in ``work`` (a checkpoint named with its latest iteration)."""
    found = []
    for name in OUTPUTS:
        path = work / name
        if not path.exists():
            continue
        tracker = path / "latest_checkpointed_iteration.txt"
        if name == "checkpoints" and tracker.is_file():
            found.append(f"checkpoints/ (iteration {tracker.read_text().strip()})")
        else:
            found.append(name + ("/" if path.is_dir() else ""))
    return found


def warmup_iters(args: argparse.Namespace) -> int:
    """The learning-rate warm-up: ``--lr-warmup-iters``, else 20 steps clamped to a fifth of the run."""
    if args.lr_warmup_iters is None:
        return min(WARMUP_ITERS, args.train_iters // 5)
    if not 0 <= args.lr_warmup_iters < args.train_iters:
        raise UsageError(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be >= 0 and smaller than --train-iters "
                         f"({args.train_iters})")
    return args.lr_warmup_iters


def check_args(args: argparse.Namespace) -> None:
    """Refuse values the steps would fail on, before anything is written."""
    if args.train_iters < 1:
        raise UsageError(f"--train-iters ({args.train_iters}) must be >= 1")
    if args.eval_interval < 1:
        raise UsageError(f"--eval-interval ({args.eval_interval}) must be >= 1")
    if not args.corpus_mb > 0:
        raise UsageError(f"--corpus-mb ({args.corpus_mb}) must be > 0")
    if args.vocab_size < 257:
        raise UsageError(f"--vocab-size ({args.vocab_size}) must be >= 257 (256 byte tokens and end-of-text)")


def prepare_workdir(work: Path, resume: bool) -> None:
    """Create ``work``; refuse one that holds the job's outputs unless resuming (which needs them)."""
    if work.exists() and not work.is_dir():
        raise UsageError(f"--workdir {work} is a file, not a directory")
    found = existing_outputs(work) if work.is_dir() else []
    if resume:
        needed = ["tokenizer", "stdlib_text_document.bin", "stdlib_text_document.idx"]
        missing = [name for name in needed if not (work / name).exists()]
        if missing:
            raise UsageError(f"--resume: {work} lacks {', '.join(missing)} of an earlier run; start it without "
                             "--resume")
    elif found:
        raise UsageError(f"--workdir {work} already holds this job's outputs ({', '.join(found)}); nothing was "
                         "changed. Pass --resume to continue training from its checkpoints, or choose another "
                         "--workdir")
    work.mkdir(parents=True, exist_ok=True)


def report_curves(log: Path, png: Path) -> Path | None:
    """Draw the loss curves of ``log`` into ``png`` and print where; a note instead without matplotlib."""
    written = plot_loss_curves(log, png, title="main job: GPT on the Python standard library")
    if written is None:
        print("loss curves: install matplotlib (in the dev extra) for a PNG", flush=True)
    else:
        print(f"loss curves: {written}", flush=True)
    return written


PROG = "main_job.py"


def build_parser() -> argparse.ArgumentParser:
    """The job's flags."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/main_job")
    parser.add_argument("--corpus-mb", type=float, default=6.0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--lr-warmup-iters", type=int, default=None,
                        help=f"default: {WARMUP_ITERS}, at most a fifth of --train-iters")
    parser.add_argument("--resume", action="store_true",
                        help="continue training from the checkpoints of an earlier run in --workdir (its corpus, "
                             "tokenizer and data files are reused; the log is appended to)")
    return parser


def job(args: argparse.Namespace) -> int:
    """The four steps; returns the exit status."""
    check_args(args)
    warmup = warmup_iters(args)
    work = (REPO / args.workdir).resolve()
    prepare_workdir(work, args.resume)
    corpus, prefix, ckpt = work / "stdlib.jsonl", work / "stdlib", work / "checkpoints"
    log = work / "train_log.jsonl"
    tokenizer_json = str(work / "tokenizer" / "tokenizer.json")
    if not args.resume:
        docs = collect_corpus(corpus, int(args.corpus_mb * 1e6))
        print(f"corpus: {docs} documents from the Python standard library -> {corpus}", flush=True)

        from megatron_core.datasets.tokenizers import train_bpe_tokenizer

        tokenizer_json = train_bpe_tokenizer([str(corpus)], args.vocab_size, str(work / "tokenizer"))["tokenizer_json"]
        print(f"tokenizer: byte-level BPE, vocab {args.vocab_size} -> {tokenizer_json}", flush=True)
        run([sys.executable, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(prefix),
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_json,
             "--append-eod", "--workers", "2"])

    run([sys.executable, "examples/pretrain_gpt.py",
         "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "352",
         "--seq-length", "256", "--max-position-embeddings", "256", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", str(args.train_iters),
         "--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", str(warmup), "--lr-decay-style", "cosine",
         "--weight-decay", "0.1", "--clip-grad", "1.0",
         "--data-path", str(prefix) + "_text_document", "--split", "95,5,0",
         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_json,
         "--data-cache-path", str(work / "index_cache"),
         "--log-interval", "10", "--eval-interval", str(args.eval_interval), "--eval-iters", "8",
         "--fixed-validation-set", *(["--load", str(ckpt)] if args.resume else []),
         "--save", str(ckpt), "--log-json", str(log), "--no-progress", "--seed", "1234"])

    curve = [json.loads(line) for line in log.read_text().splitlines()]
    valid = [(r["iteration"], r["validation loss"]) for r in curve if r["kind"] == "valid"]
    if not valid:
        raise UsageError(f"{log} holds no validation loss (was --train-iters above the checkpoint's iteration?)")
    print("\nvalidation loss by iteration:")
    for iteration, loss in valid:
        print(f"  {iteration:5d}  {loss:.4f}")
    falling = all(b[1] < a[1] for a, b in zip(valid, valid[1:]))
    print(f"validation loss {valid[0][1]:.3f} -> {valid[-1][1]:.3f}; "
          f"{'falling at every evaluation' if falling else 'NOT falling at every evaluation'}; checkpoint in {ckpt}")
    report_curves(log, work / "loss_curves.png")
    if valid[-1][1] >= valid[0][1]:
        print("validation loss did not fall", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the job; a bad flag or work directory ends it with one line and status 2, a failed step with its own."""
    args = build_parser().parse_args(argv)
    try:
        return run_command(PROG, lambda: job(args))
    except subprocess.CalledProcessError as failed:  # the step printed its own error above
        print(f"{PROG}: error: step {Path(failed.cmd[1]).name} exited with status {failed.returncode}",
              file=sys.stderr)
        return failed.returncode if failed.returncode > 0 else 1

if __name__ == "__main__":
    sys.exit(main())
