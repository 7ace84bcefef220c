"""preprocess_data: outputs equal direct tokenisation, workers/partitions agree, bad input is reported."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy
import pytest

from megatron_core.datasets import IndexedDataset
from megatron_core.datasets.preprocess_data import main, split_sentences
from megatron_core.datasets.tokenizers import GPT2BPETokenizer

DOCUMENTS = [
    "The first document. It has two sentences!",
    "",
    "Line one\nline two? Yes.\n\nAfter a blank line.",
    "ünïcödé text 🙂 and tabs\tinside.",
    "x",
] * 3


def _write_jsonl(path, texts, extra_lines=()) -> str:
    lines = [json.dumps({"text": text, "id": index}) for index, text in enumerate(texts)]
    lines[2:2] = list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _gpt2_flags(bpe_files) -> list[str]:
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", bpe_files["vocab_file"],
            "--merge-file", bpe_files["merge_file"]]


def _read(prefix: str) -> tuple[list[list[int]], list[int], numpy.dtype]:
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))], dataset.document_indices.tolist(), dataset[0].dtype


def test_documents_equal_direct_tokenisation(bpe_files, tmp_path, capsys):
    tokenizer = GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"])
    source = _write_jsonl(tmp_path / "in.jsonl", DOCUMENTS)
    expected = [tokenizer.tokenize(text) + [tokenizer.eod] for text in DOCUMENTS if text]
    boundaries = numpy.cumsum([0] + [1 if text else 0 for text in DOCUMENTS]).tolist()
    outputs = {}
    for workers, partitions in ((1, 1), (2, 2)):
        prefix = str(tmp_path / f"out{workers}")
        main(["--input", source, "--output-prefix", prefix, *_gpt2_flags(bpe_files), "--append-eod",
              "--workers", str(workers), "--partitions", str(partitions), "--log-interval", "4"])
        outputs[workers] = (open(prefix + "_text_document.bin", "rb").read(),
                            open(prefix + "_text_document.idx", "rb").read())
        sequences, documents, dtype = _read(prefix + "_text_document")
        if partitions == 1:
            assert sequences == expected and documents == boundaries and dtype == numpy.uint16
    stderr = capsys.readouterr().err
    assert "Processed 4 documents (" in stderr and "docs/s" in stderr and "MB/s" in stderr
    # Partitions deal lines round-robin and concatenate in partition order (Megatron's order).
    order = list(range(0, len(DOCUMENTS), 2)) + list(range(1, len(DOCUMENTS), 2))
    prefix = str(tmp_path / "reordered")
    _write_jsonl(tmp_path / "reordered.jsonl", [DOCUMENTS[i] for i in order])
    main(["--input", str(tmp_path / "reordered.jsonl"), "--output-prefix", prefix, *_gpt2_flags(bpe_files),
          "--append-eod", "--workers", "1"])
    assert outputs[2] == (open(prefix + "_text_document.bin", "rb").read(),
                          open(prefix + "_text_document.idx", "rb").read())


def test_split_sentences_keys_and_int32(bpe_files, tmp_path):
    assert split_sentences("One. Two!  Three?\nFour", False) == ["One.", "Two!", "Three?", "Four"]
    assert split_sentences("A b.\n\nC.", True) == ["A b.\n\n", "C."]
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"text": "One. Two!", "title": "Hi"}) + "\n")
    prefix = str(tmp_path / "s")
    main(["--input", str(source), "--output-prefix", prefix, "--json-keys", "text", "title", "--split-sentences",
          *_gpt2_flags(bpe_files), "--workers", "1"])
    tokenizer = GPT2BPETokenizer(bpe_files["vocab_file"], bpe_files["merge_file"])
    sequences, documents, _ = _read(prefix + "_text_sentence")
    assert sequences == [tokenizer.tokenize("One."), tokenizer.tokenize("Two!")] and documents == [0, 2]
    assert _read(prefix + "_title_sentence")[0] == [tokenizer.tokenize("Hi")]

    source.write_text(json.dumps({"text": "65535 70000 3"}) + "\n")
    main(["--input", str(source), "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer",
          "--vocab-size", "70000", "--append-eod", "--workers", "1"])
    sequences, _, dtype = _read(prefix + "_text_document")
    assert sequences == [[65535, 70000, 3, 70000]] and dtype == numpy.int32


def test_bad_input(bpe_files, tmp_path, capsys):
    source = _write_jsonl(tmp_path / "in.jsonl", DOCUMENTS[:4], extra_lines=['{"text": oops}', '{"title": "x"}'])
    prefix = str(tmp_path / "bad")
    flags = ["--input", source, "--output-prefix", prefix, *_gpt2_flags(bpe_files), "--workers", "1"]
    assert main(flags) == 2
    assert re.search(r"in\.jsonl:3: malformed JSON \(Expecting value at column 10\)", capsys.readouterr().err)
    main([*flags, "--skip-bad-records"])
    stderr = capsys.readouterr().err
    assert "skipping" in stderr and "in.jsonl:4: no key 'text'" in stderr and "Skipped 2 bad record(s)" in stderr
    assert len(_read(prefix + "_text_document")[1]) == 5  # 4 documents (one empty)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    main(["--input", str(empty), "--output-prefix", prefix, *_gpt2_flags(bpe_files), "--workers", "2"])
    assert "held no documents" in capsys.readouterr().err
    dataset = IndexedDataset(prefix + "_text_document")
    assert len(dataset) == 0 and dataset.document_indices.tolist() == [0]
    assert main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", prefix, *_gpt2_flags(bpe_files),
                 "--workers", "1"]) == 2
    assert re.search("--input .*missing.jsonl does not exist", capsys.readouterr().err)
    assert main(["--input", source, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
                 "--workers", "1"]) == 2
    assert "needs vocab_file, merge_file" in capsys.readouterr().err


def test_parquet_input_equals_jsonl(bpe_files, tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    parquet.write_table(pyarrow.table({"text": DOCUMENTS, "id": list(range(len(DOCUMENTS)))}),
                        str(tmp_path / "in.parquet"))
    _write_jsonl(tmp_path / "in.jsonl", DOCUMENTS)
    results = []
    for name in ("in.parquet", "in.jsonl"):
        prefix = str(tmp_path / name.replace(".", "_"))
        main(["--input", str(tmp_path / name), "--output-prefix", prefix, *_gpt2_flags(bpe_files), "--append-eod",
              "--workers", "2"])
        results.append(_read(prefix + "_text_document"))
    assert results[0] == results[1]


def test_command_line_tool(bpe_files, tmp_path):
    source = _write_jsonl(tmp_path / "in.jsonl", DOCUMENTS[:2])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    completed = subprocess.run(
        [sys.executable, os.path.join(root, "tools", "preprocess_data.py"), "--input", source,
         "--output-prefix", str(tmp_path / "cli"), *_gpt2_flags(bpe_files), "--workers", "1"],
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    assert "Wrote" in completed.stderr and len(IndexedDataset(str(tmp_path / "cli_text_document"))) == 1
