"""Preprocessing throughput: ``.bin``/``.idx`` write speed vs megatron-core, and ``preprocess_data`` end to end.

megatron-core's wheel does not ship Megatron-LM's ``tools/preprocess_data.py``, so the comparison
with it is on the part both libraries own, ``IndexedDatasetBuilder``: ``--documents`` random
documents (token lists, mean ``--mean-document-length``) written with ``add_document`` and
finalised, for each library; the two outputs are asserted byte-identical. Then our
``preprocess_data`` runs on a JSONL corpus made of the Python standard library's sources (40-line
documents, repeated to ``--corpus-mb``) with a BPE tokenizer trained on them, for
the Hugging Face tokenizer (Rust) and the pure-Python GPT-2 BPE, at 1 and ``--workers`` workers.

    python benchmarks/datasets_preprocess.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy

from megatron_core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron_core.datasets.preprocess_data import main as preprocess_main
from megatron_core.datasets.tokenizers import train_bpe_tokenizer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=50_000)
    parser.add_argument("--mean-document-length", type=int, default=500)
    parser.add_argument("--corpus-mb", type=float, default=4.0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    return parser.parse_args()


def write_documents(builder_cls: type, prefix: str, documents: list[list[int]]) -> float:
    """Seconds to add every document and finalise."""
    started = time.perf_counter()
    builder = builder_cls(prefix + ".bin", dtype=numpy.uint16)
    for document in documents:
        builder.add_document(document, [len(document)])
    builder.finalize(prefix + ".idx")
    return time.perf_counter() - started


def reference_builder() -> Any:
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as Reference
    except ImportError:
        return None
    return Reference


def make_corpus(path: str, megabytes: float) -> tuple[int, int]:
    """A JSONL file of standard-library sources in 40-line documents; returns (documents, bytes)."""
    sources = []
    for root, _, files in os.walk(sysconfig.get_paths()["stdlib"]):
        if "test" in root or "site-packages" in root:
            continue
        sources += [os.path.join(root, name) for name in sorted(files) if name.endswith(".py")]
    documents = written = 0
    with open(path, "w", encoding="utf-8") as stream:
        while written < megabytes * 1024 * 1024:
            for source in sources:
                lines = open(source, encoding="utf-8", errors="replace").readlines()
                for start in range(0, len(lines), 40):
                    line = json.dumps({"text": "".join(lines[start : start + 40])}) + "\n"
                    stream.write(line)
                    documents += 1
                    written += len(line.encode("utf-8"))
                if written >= megabytes * 1024 * 1024:
                    break
    return documents, written


def run_preprocess(flags: list[str]) -> float:
    started = time.perf_counter()
    preprocess_main(flags)
    return time.perf_counter() - started


def report(name: str, seconds: float, documents: int, size: int) -> None:
    print(f"{name:<52} {seconds:7.2f} s  {documents / seconds:10.0f} docs/s  {size / seconds / 2**20:8.2f} MB/s")


def main() -> None:
    args = parse_args()
    print(f"{platform.node()} | {os.cpu_count()} CPUs | load {os.getloadavg()[0]:.1f} | Python {sys.version.split()[0]}")
    rng = numpy.random.default_rng(0)
    lengths = rng.integers(1, 2 * args.mean_document_length, args.documents)
    documents = [rng.integers(0, 50000, length).tolist() for length in lengths]
    size = int(lengths.sum()) * 2
    timings: dict[str, Callable[[str], float]] = {"ours": lambda p: write_documents(IndexedDatasetBuilder, p, documents)}
    reference = reference_builder()
    if reference is not None:
        timings["megatron-core"] = lambda p: write_documents(reference, p, documents)
    with tempfile.TemporaryDirectory() as directory:
        outputs = {}
        for name, function in timings.items():
            prefix = os.path.join(directory, name)
            report(f"IndexedDatasetBuilder.add_document, {name}", function(prefix), args.documents, size)
            outputs[name] = [open(prefix + suffix, "rb").read() for suffix in (".bin", ".idx")]
        if len(outputs) == 2:
            assert outputs["ours"] == outputs["megatron-core"], "outputs differ"
            print("outputs byte-identical: yes")

        corpus = os.path.join(directory, "corpus.jsonl")
        count, corpus_bytes = make_corpus(corpus, args.corpus_mb)
        print(f"corpus: {count} documents, {corpus_bytes / 2**20:.1f} MB of JSONL")
        tokenizer = train_bpe_tokenizer([corpus], 8000, os.path.join(directory, "bpe"))
        hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer["tokenizer_json"]]
        gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", tokenizer["vocab_file"],
                "--merge-file", tokenizer["merge_file"]]
        for name, flags in (("HuggingFaceTokenizer", hf), ("GPT2BPETokenizer (pure Python)", gpt2)):
            for workers in sorted({1, args.workers}):
                seconds = run_preprocess(["--input", corpus, "--output-prefix", os.path.join(directory, "out"),
                                          "--append-eod", "--workers", str(workers), "--log-interval", "0", *flags])
                report(f"preprocess_data, {name}, {workers} worker(s)", seconds, count, corpus_bytes)


if __name__ == "__main__":
    main()
