"""Tokenise a JSONL or Parquet corpus into Megatron ``.bin``/``.idx`` files (``tools/preprocess_data.py``).

Same flags and outputs as Megatron-LM's tool: for each ``--json-keys`` key it writes
``<output-prefix>_<key>_document.{bin,idx}`` (``_sentence`` with ``--split-sentences``), one document
per record and one sequence per document (per sentence when splitting), ``--append-eod`` adding
the tokenizer's eod to each non-empty document, in the smallest dtype that holds the vocab (uint16
below 65500 ids, else int32). An empty text still ends a document (with no sequences), as Megatron.
Tokenisation runs in ``--workers`` processes; with ``--partitions N`` the records are dealt
round-robin into N partitions, encoded one after the other and concatenated in partition order
(Megatron's order). Additions: Parquet input, and ``--skip-bad-records`` (without it a malformed
line stops the run with its line number). Sentence splitting uses a small built-in splitter instead
of NLTK (see docs/datasets.md). Run as ``python -m megatron_core.datasets.preprocess_data``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

from megatron_core.command_line import run_command
from megatron_core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron_core.datasets.preprocess_input import BadRecordError, parse_record, read_records
from megatron_core.progress import progress_bar
from megatron_core.tokenizers.legacy.build import TOKENIZER_TYPES, build_tokenizer

_SENTENCE_END = re.compile(r"(?<=[.!?])[ \t]+|(?<=[.!?])(?=\n)")


def split_sentences(text: str, keep_newlines: bool) -> list[str]:
    """Split after ``.``, ``!`` or ``?`` followed by white space, and at line breaks.

    With ``keep_newlines`` a sentence keeps its trailing line break(s); otherwise they are dropped.
    Empty sentences are removed.
    """
    sentences = []
    for line in re.findall(r"[^\n]*\n*", text):
        newline = line[len(line.rstrip("\n")) :]
        pieces = [piece for piece in _SENTENCE_END.split(line.rstrip("\n")) if piece.strip()]
        if keep_newlines and pieces:
            pieces[-1] += newline
        sentences.extend(pieces)
    return sentences


def _tokenizer_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "tokenizer_type": args.tokenizer_type,
        "vocab_file": args.vocab_file,
        "merge_file": args.merge_file,
        "tokenizer_model": args.tokenizer_model,
        "vocab_size": args.vocab_size,
        "tiktoken_pattern": args.tiktoken_pattern,
    }


class Encoder:
    """Turns records into token ids with one tokenizer (one instance per worker process)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tokenizer = build_tokenizer(**_tokenizer_options(args))
        self.vocab_size = self.tokenizer.vocab_size

    def encode(self, record: tuple[int, str | dict[str, Any]]) -> tuple[int, dict, dict, int, str | None]:
        """``(number, payload)`` to ``(number, ids per key, sequence lengths per key, bytes, error or None)``."""
        number, payload = record
        try:
            texts, size = parse_record(payload, self.args.json_keys)
        except BadRecordError as error:
            return number, {}, {}, 0, str(error)
        ids, lengths = {}, {}
        for key, text in texts.items():
            pieces = split_sentences(text, self.args.keep_newlines) if self.args.split_sentences else [text]
            document: list[int] = []
            sentence_lengths: list[int] = []
            for piece in pieces:
                try:
                    sentence = self.tokenizer.tokenize(piece)
                except Exception as error:  # noqa: BLE001 - the record is reported with its number
                    return number, {}, {}, 0, f"key {key!r}: the tokenizer failed ({type(error).__name__}: {error})"
                outside = [t for t in sentence if not 0 <= t < self.vocab_size]
                if outside:
                    return number, {}, {}, 0, (f"key {key!r}: token id {outside[0]} is outside the tokenizer's "
                                               f"vocabulary (0..{self.vocab_size - 1})")
                if len(sentence) > 0:
                    document.extend(sentence)
                    sentence_lengths.append(len(sentence))
            if sentence_lengths and self.args.append_eod:
                document.append(self.tokenizer.eod)
                sentence_lengths[-1] += 1
            ids[key], lengths[key] = document, sentence_lengths
        return number, ids, lengths, size, None


_worker_encoder: Encoder | None = None


def _init_worker(args: argparse.Namespace) -> None:
    global _worker_encoder
    # Pool.terminate() must end the worker, whatever SIGTERM handler its start method left it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_encoder = Encoder(args)


def _encode_in_worker(record: tuple[int, Any]) -> tuple[int, dict, dict, int, str | None]:
    assert _worker_encoder is not None, "_init_worker must run first"
    return _worker_encoder.encode(record)


def _output_prefix(prefix: str, key: str, level: str) -> str:
    return f"{prefix}_{key}_{level}"


class _Progress:
    """Counts documents, bytes and skipped records; a tqdm counter on a terminal, else Megatron-style lines."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.started = time.time()
        self.documents = self.bytes = self.skipped = 0
        self.bar = progress_bar(None, "preprocess", unit="doc", enabled=interval > 0, stream=sys.stderr)

    def line(self) -> str:
        elapsed = max(time.time() - self.started, 1e-9)
        return (
            f"Processed {self.documents} documents ({self.documents / elapsed:.1f} docs/s, "
            f"{self.bytes / elapsed / 1024 / 1024:.2f} MB/s)."
        )

    def add(self, size: int) -> None:
        self.documents += 1
        self.bytes += size
        at_interval = self.interval and self.documents % self.interval == 0
        if self.bar is not None:
            elapsed = max(time.time() - self.started, 1e-9)
            self.bar.update(1, f"{self.bytes / elapsed / 1024 / 1024:.2f} MB/s" if at_interval else None)
        elif at_interval:
            print(self.line(), file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _encode_partition(
    args: argparse.Namespace, records: Iterable[tuple[int, Any]], prefix: str, progress: _Progress
) -> None:
    """Encode ``records`` into ``<prefix>_<key>_<level>`` files."""
    dtype = DType.optimal_dtype(build_tokenizer(**_tokenizer_options(args)).vocab_size)
    level = "sentence" if args.split_sentences else "document"
    builders = {
        key: IndexedDatasetBuilder(get_bin_path(_output_prefix(prefix, key, level)), dtype=dtype)
        for key in args.json_keys
    }
    if args.workers > 1:
        # Spawned, not forked: a fork of a process with other threads running (a test session's rank pools, torch's
        # thread pools) can copy a lock one of them holds and hang the worker for good.
        pool = multiprocessing.get_context("spawn").Pool(args.workers, initializer=_init_worker, initargs=(args,))
        encoded: Iterator = pool.imap(_encode_in_worker, records, 32)
    else:
        pool = None
        encoded = map(Encoder(args).encode, records)
    try:
        for number, ids, lengths, size, error in encoded:
            if error is not None:
                where = f"{args.input}:{number}"
                if not args.skip_bad_records:
                    raise BadRecordError(f"{where}: {error} (pass --skip-bad-records to skip such records)")
                progress.skipped += 1
                progress.message(f"skipping {where}: {error}")
                continue
            for key in args.json_keys:
                builders[key].add_document(ids[key], lengths[key])
            progress.add(size)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    for key in args.json_keys:
        builders[key].finalize(get_idx_path(_output_prefix(prefix, key, level)))


def _check_args(args: argparse.Namespace) -> None:
    """Refuse, before anything is written, what would fail later: the input, the counts, the outputs, the tokenizer."""
    if os.path.isdir(args.input):
        raise IsADirectoryError(f"--input {args.input} is a directory; give a .jsonl or .parquet file")
    if not os.path.isfile(args.input):
        raise FileNotFoundError(f"--input {args.input} does not exist")
    if args.partitions < 1 or args.workers < 1:
        raise ValueError(f"--workers ({args.workers}) and --partitions ({args.partitions}) must be >= 1")
    if args.log_interval < 0:
        raise ValueError(f"--log-interval ({args.log_interval}) must be >= 0")
    if not os.path.basename(args.output_prefix):
        raise ValueError(f"--output-prefix {args.output_prefix!r} ends with a separator; give a file name prefix")
    level = "sentence" if args.split_sentences else "document"
    for key in args.json_keys:
        prefix = _output_prefix(args.output_prefix, key, level)
        for path in (get_bin_path(prefix), get_idx_path(prefix)):
            if os.path.lexists(path) and (os.path.islink(path) or not os.path.isfile(path)):
                raise FileExistsError(f"output {path} exists and is not a regular file; nothing was changed")
    try:
        build_tokenizer(**_tokenizer_options(args))
    except (ValueError, OSError, ImportError):
        raise
    except Exception as error:  # noqa: BLE001 - tokenizer libraries raise plain Exception on a bad file
        files = [f for f in (args.tokenizer_model, args.vocab_file, args.merge_file) if f]
        raise ValueError(f"cannot build the {args.tokenizer_type} from {files}: {type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}") from error


def _publish(staged: str, prefix: str, keys: list[str], level: str) -> None:
    """Move the finished ``staged`` pairs to ``prefix``: old ``.idx`` out, new ``.bin`` in, new ``.idx`` last.

    Every moment a reader either finds a complete pair (old or new) or a ``.bin`` without its
    ``.idx``, which refuses to open: never a new ``.bin`` read through an old ``.idx``.
    """
    for key in keys:
        source, target = _output_prefix(staged, key, level), _output_prefix(prefix, key, level)
        for path in (get_bin_path(source), get_idx_path(source)):
            with open(path, "rb") as stream:
                os.fsync(stream.fileno())
        if os.path.lexists(get_idx_path(target)):
            os.unlink(get_idx_path(target))
        os.replace(get_bin_path(source), get_bin_path(target))
        os.replace(get_idx_path(source), get_idx_path(target))


def preprocess(args: argparse.Namespace) -> list[str]:
    """Run the conversion; returns the output prefixes written (one per JSON key).

    Everything is written into a temporary directory beside the outputs and moved into place only
    when the whole input was encoded (:func:`_publish`): a failure leaves earlier outputs of the same
    prefix as they were and removes the temporary files. Partitions are encoded one after the other,
    each with all ``--workers`` processes, and then merged in partition order.
    """
    _check_args(args)
    output_directory = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(output_directory, exist_ok=True)
    level = "sentence" if args.split_sentences else "document"
    outputs = [_output_prefix(args.output_prefix, key, level) for key in args.json_keys]
    progress = _Progress(args.log_interval)
    temporary = tempfile.mkdtemp(dir=output_directory, prefix=".preprocess-")
    try:
        staged = os.path.join(temporary, "output")
        if args.partitions == 1:
            _encode_partition(args, read_records(args.input, args.json_keys), staged, progress)
        else:
            parts = [os.path.join(temporary, f"part{index}") for index in range(args.partitions)]
            for index, prefix in enumerate(parts):
                records = read_records(args.input, args.json_keys, index, args.partitions)
                _encode_partition(args, records, prefix, progress)
            dtype = DType.optimal_dtype(build_tokenizer(**_tokenizer_options(args)).vocab_size)
            for key in args.json_keys:
                builder = IndexedDatasetBuilder(get_bin_path(_output_prefix(staged, key, level)), dtype=dtype)
                for prefix in parts:
                    builder.add_index(_output_prefix(prefix, key, level))
                builder.finalize(get_idx_path(_output_prefix(staged, key, level)))
        _publish(staged, args.output_prefix, args.json_keys, level)
    finally:
        progress.close()
        shutil.rmtree(temporary, ignore_errors=True)
    summary = progress.line()
    if progress.skipped:
        summary += f" Skipped {progress.skipped} bad record(s)."
    if progress.documents == 0:
        summary += f" Warning: {args.input} held no documents; the outputs are empty."
    print(summary, file=sys.stderr, flush=True)
    return outputs


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse Megatron's ``preprocess_data.py`` flags."""
    parser = argparse.ArgumentParser(description="Tokenise a JSONL corpus into Megatron .bin/.idx files.")
    group = parser.add_argument_group("input data")
    group.add_argument(
        "--input", type=str, required=True, help="JSONL file (one document per line) or .parquet file (needs pyarrow)"
    )
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    group.add_argument("--split-sentences", action="store_true", help="one sequence per sentence")
    group.add_argument("--keep-newlines", action="store_true", help="keep line breaks when splitting sentences")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", type=str, required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", type=str, default=None, help="GPT-2 vocab.json")
    group.add_argument("--merge-file", type=str, default=None, help="GPT-2 merges.txt")
    group.add_argument("--tokenizer-model", type=str, default=None, help="tokenizer.json / tiktoken / .model file")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer / TikTokenizer vocab size")
    group.add_argument("--tiktoken-pattern", type=str, default=None, help="v1 or v2")
    group.add_argument("--append-eod", action="store_true", help="append the eod token to every document")
    group.add_argument("--lang", type=str, default="english", help="accepted for compatibility (no NLTK)")
    group.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="skip malformed JSON lines / records missing a key (reported with their line number) instead of failing",
    )
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", type=str, required=True)
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, required=True, help="tokenising processes")
    group.add_argument(
        "--partitions", type=int, default=1, help="deal records round-robin into this many partitions (merged in order)"
    )
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; a user error exits with status 2 and one line (:mod:`megatron_core.command_line`)."""
    started = time.time()
    args = get_args(argv)

    def body() -> None:
        prefixes = preprocess(args)
        print(f"Wrote {', '.join(prefixes)} in {time.time() - started:.1f} s", file=sys.stderr)

    return run_command("megatron-preprocess-data", body)


if __name__ == "__main__":
    sys.exit(main())
