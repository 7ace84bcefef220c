"""The README's main job: train a small GPT end to end on CPU on real text every machine has offline.

1. Collect the Python standard library's source files into a JSONL corpus.
2. Train a byte-level BPE tokenizer on it (``megatron_core.datasets.tokenizers.train_bpe_tokenizer``).
3. Tokenize the corpus into Megatron ``.bin``/``.idx`` files with ``tools/preprocess_data.py``.
4. Train a small GPT with ``examples/pretrain_gpt.py`` (evaluation every 25 steps, a checkpoint at the end),
   then print the validation-loss curve and check that it fell; with matplotlib installed, the train and
   validation loss curves are also drawn into ``loss_curves.png`` beside the logs (its path is printed).

Run from the repository root: ``python examples/main_job.py`` (``--help`` for sizes). Everything is written
under ``--workdir`` (default ``runs/main_job``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))  # gpt_training (this script may be started from anywhere)

from gpt_training.plots import plot_loss_curves  # noqa: E402


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


def report_curves(log: Path, png: Path) -> Path | None:
    """Draw the loss curves of ``log`` into ``png`` and print where; a note instead without matplotlib."""
    written = plot_loss_curves(log, png, title="main job: GPT on the Python standard library")
    if written is None:
        print("loss curves: install matplotlib (in the dev extra) for a PNG", flush=True)
    else:
        print(f"loss curves: {written}", flush=True)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/main_job")
    parser.add_argument("--corpus-mb", type=float, default=6.0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--eval-interval", type=int, default=25)
    args = parser.parse_args()

    work = (REPO / args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "stdlib.jsonl"
    docs = collect_corpus(corpus, int(args.corpus_mb * 1e6))
    print(f"corpus: {docs} documents from the Python standard library -> {corpus}", flush=True)

    from megatron_core.datasets.tokenizers import train_bpe_tokenizer

    paths = train_bpe_tokenizer([str(corpus)], args.vocab_size, str(work / "tokenizer"))
    print(f"tokenizer: byte-level BPE, vocab {args.vocab_size} -> {paths['tokenizer_json']}", flush=True)

    prefix = work / "stdlib"
    run([sys.executable, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(prefix),
         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", paths["tokenizer_json"],
         "--append-eod", "--workers", "2"])

    log = work / "train_log.jsonl"
    log.unlink(missing_ok=True)
    ckpt = work / "checkpoints"
    shutil.rmtree(ckpt, ignore_errors=True)  # each run of the job trains from scratch
    run([sys.executable, "examples/pretrain_gpt.py",
         "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "352",
         "--seq-length", "256", "--max-position-embeddings", "256", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", str(args.train_iters),
         "--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "20", "--lr-decay-style", "cosine",
         "--weight-decay", "0.1", "--clip-grad", "1.0",
         "--data-path", str(prefix) + "_text_document", "--split", "95,5,0",
         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", paths["tokenizer_json"],
         "--data-cache-path", str(work / "index_cache"),
         "--log-interval", "10", "--eval-interval", str(args.eval_interval), "--eval-iters", "8",
         "--fixed-validation-set",
         "--save", str(ckpt), "--log-json", str(log), "--no-progress", "--seed", "1234"])

    curve = [json.loads(line) for line in log.read_text().splitlines()]
    valid = [(r["iteration"], r["validation loss"]) for r in curve if r["kind"] == "valid"]
    print("\nvalidation loss by iteration:")
    for iteration, loss in valid:
        print(f"  {iteration:5d}  {loss:.4f}")
    falling = all(b[1] < a[1] for a, b in zip(valid, valid[1:]))
    print(f"validation loss {valid[0][1]:.3f} -> {valid[-1][1]:.3f}; "
          f"{'falling at every evaluation' if falling else 'NOT falling at every evaluation'}; checkpoint in {ckpt}")
    report_curves(log, work / "loss_curves.png")
    if valid[-1][1] >= valid[0][1]:
        sys.exit("validation loss did not fall")


if __name__ == "__main__":
    main()
