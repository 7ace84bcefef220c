"""``megatron-preprocess-data`` against bad inputs, bad flags and faults at each write step.

Every case starts from an output directory holding a complete earlier pair for the same prefix.
A user error must exit with status 2 and one line naming what and where, and leave that
directory exactly as it was (no temporaries); a valid but odd input must give the right result.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy
import pytest

from megatron_core.datasets import IndexedDataset
from megatron_core.datasets import preprocess_data as module
from megatron_core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron_core.datasets.preprocess_data import main
from tests.reliability.tools_adversarial.conftest import fingerprint

OLD = [[1, 2], [3, 4, 5]]  # the earlier pair's documents


def _lines(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


@pytest.fixture
def workspace(tmp_path):
    """``(input path, output prefix)`` with an earlier complete pair at the prefix."""
    out = tmp_path / "out"
    out.mkdir()
    prefix = str(out / "corpus")
    source = tmp_path / "old.jsonl"
    source.write_text(_lines(*({"text": " ".join(map(str, d))} for d in OLD)))
    assert main(_flags(str(source), prefix)) == 0
    return tmp_path / "in.jsonl", prefix


def _flags(source: str, prefix: str, *extra: str) -> list[str]:
    return ["--input", source, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
            "--workers", "1", "--log-interval", "0", *extra]


def _documents(prefix: str, key: str = "text") -> list[list[int]]:
    dataset = IndexedDataset(f"{prefix}_{key}_document")
    return [dataset[i].tolist() for i in range(len(dataset))]


# (id, input bytes or None for "do not create", extra flags, expected message fragments)
REFUSED = [
    ("missing-input", None, [], ["does not exist"]),
    ("malformed-json-line-30", _lines(*([{"text": "1"}] * 29), '{"text": 1 2', {"text": "3"}), [], [":30: malformed JSON"]),
    ("json-array", _lines([1, 2, 3]), [], [":1: expected a JSON object, got list"]),
    ("json-string", _lines('"just text"'), [], [":1: expected a JSON object, got str"]),
    ("wrong-json-key", _lines({"content": "1 2"}), [], [":1: no key 'text'", "--json-keys"]),
    ("second-key-missing", _lines({"text": "1", "title": "2"}, {"text": "3"}), ["--json-keys", "text", "title"],
     [":2: no key 'title'"]),
    ("number-value", _lines({"text": 12}), [], [":1: key 'text' holds int, not a string"]),
    ("list-value", _lines({"text": ["1"]}), [], [":1: key 'text' holds list"]),
    ("binary-input", b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe\xfd garbage\n", [], [":1: not UTF-8 text"]),
    ("latin1-line-2", b'{"text": "1"}\n{"text": "caf\xe9"}\n', [], [":2: not UTF-8 text"]),
    ("utf8-bom", "\ufeff" + _lines({"text": "1"}), [], [":1: malformed JSON"]),
    ("truncated-last-line", _lines({"text": "1"}) + '{"text": "2', [], [":2: malformed JSON"]),
    ("tokenizer-rejects-text", _lines({"text": "1 2"}, {"text": "one two"}), [], [":2: key 'text': the tokenizer failed"]),
    ("token-id-beyond-int64", _lines({"text": "1"}, {"text": "99999999999999999999"}), [], [":2: key 'text': token id"]),
    ("token-id-outside-vocab", _lines({"text": "1"}, {"text": "5 1001"}), [], [":2: key 'text': token id 1001 is outside"]),
    ("negative-token-id", _lines({"text": "-4"}), [], [":1: key 'text': token id -4 is outside"]),
    ("workers-zero", _lines({"text": "1"}), ["--workers", "0"], ["--workers (0)", "must be >= 1"]),
    ("workers-negative", _lines({"text": "1"}), ["--workers", "-3"], ["--workers (-3)"]),
    ("partitions-zero", _lines({"text": "1"}), ["--partitions", "0"], ["--partitions (0)"]),
    ("log-interval-negative", _lines({"text": "1"}), ["--log-interval", "-1"], ["--log-interval (-1)"]),
    ("bad-line-with-2-workers", _lines(*([{"text": "1"}] * 40), "{", {"text": "2"}), ["--workers", "2"], [":41:"]),
    ("bad-line-in-partition-3", _lines(*([{"text": "1"}] * 10), "[", {"text": "2"}), ["--partitions", "3"], [":11:"]),
    ("gpt2-without-vocab", _lines({"text": "a"}), ["--tokenizer-type", "GPT2BPETokenizer"], ["vocab_file"]),
    ("gpt2-vocab-missing-file", _lines({"text": "a"}), ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                                         "/nonexistent/vocab.json", "--merge-file", "/nonexistent/m.txt"],
     ["/nonexistent/"]),
    ("hf-tokenizer-missing", _lines({"text": "a"}), ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                                     "/nonexistent/tokenizer.json"], ["/nonexistent/tokenizer.json"]),
]


@pytest.mark.parametrize("name, content, extra, fragments", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_inputs_leave_earlier_outputs_alone(workspace, capsys, name, content, extra, fragments) -> None:
    source, prefix = workspace
    if content is not None:
        source.write_bytes(content.encode() if isinstance(content, str) else content)
    out = os.path.dirname(prefix)
    before = fingerprint(out)
    flags = _flags(str(source), prefix)
    if "--tokenizer-type" in extra:  # replace the NullTokenizer flags
        flags = ["--input", str(source), "--output-prefix", prefix, "--workers", "1", "--log-interval", "0"]
    assert main([*flags, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megatron-preprocess-data: error: "), err
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])
    assert fingerprint(out) == before
    assert _documents(prefix) == OLD


@pytest.mark.parametrize("name, files, message", [
    ("tokenizer-json-garbage", {"tokenizer.json": b"{not json"}, "HuggingFaceTokenizer: cannot read"),
    ("tokenizer-json-empty", {"tokenizer.json": b""}, "HuggingFaceTokenizer: cannot read"),
    ("tokenizer-json-wrong-schema", {"tokenizer.json": b'{"model": 3}'}, "HuggingFaceTokenizer: cannot read"),
], ids=lambda v: v if isinstance(v, str) and "-" in v else "")
def test_corrupt_tokenizer_files(workspace, tmp_path, capsys, name, files, message) -> None:
    pytest.importorskip("tokenizers")
    source, prefix = workspace
    source.write_text(_lines({"text": "hello"}))
    for file_name, data in files.items():
        (tmp_path / file_name).write_bytes(data)
    before = fingerprint(os.path.dirname(prefix))
    assert main(["--input", str(source), "--output-prefix", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", str(tmp_path / "tokenizer.json"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "tokenizer.json" in err, err
    assert fingerprint(os.path.dirname(prefix)) == before


ACCEPTED = [
    ("empty-file", "", [], []),
    ("blank-lines-only", "\n\n   \n", [], []),
    ("crlf-line-endings", '{"text": "7 8"}\r\n{"text": "9"}\r\n', [], [[7, 8], [9]]),
    ("null-text-is-an-empty-document", _lines({"text": None}, {"text": "5"}), [], [[5]]),  # no sequence
    ("nul-and-escapes-in-json", _lines({"text": "1\u00002"}, {"text": "3\t4"}), [], None),
    ("extra-keys-ignored", _lines({"text": "6", "meta": {"a": [1]}}), [], [[6]]),
    ("bad-lines-skipped", _lines({"text": "1"}, "{", [2], {"text": "3"}), ["--skip-bad-records"], [[1], [3]]),
    ("binary-lines-skipped", b'{"text": "4"}\n\xff\xfe\n{"text": "5"}\n', ["--skip-bad-records"], [[4], [5]]),
    ("append-eod", _lines({"text": "1 2"}, {"text": ""}), ["--append-eod"], [[1, 2, 1000]]),
    ("partitions-keep-order", _lines(*({"text": str(i)} for i in range(7))), ["--partitions", "3"],
     [[0], [3], [6], [1], [4], [2], [5]]),
    ("two-workers", _lines(*({"text": str(i)} for i in range(50))), ["--workers", "2"], [[i] for i in range(50)]),
]


@pytest.mark.parametrize("name, content, extra, expected", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_odd_but_valid_inputs_give_the_right_documents(workspace, name, content, extra, expected) -> None:
    source, prefix = workspace
    source.write_bytes(content.encode() if isinstance(content, str) else content)
    if expected is None:  # "1\x002": the NullTokenizer reads one token per whitespace-separated integer
        assert main(_flags(str(source), prefix, *extra)) == 2
        return
    assert main(_flags(str(source), prefix, *extra)) == 0
    assert _documents(prefix) == expected
    assert sorted(os.listdir(os.path.dirname(prefix))) == ["corpus_text_document.bin", "corpus_text_document.idx"]


def test_huge_line(workspace) -> None:
    source, prefix = workspace
    ids = numpy.arange(300_000) % 997
    source.write_text(json.dumps({"text": " ".join(map(str, ids.tolist()))}) + "\n")  # one 1.7 MB line
    assert main(_flags(str(source), prefix)) == 0
    assert _documents(prefix) == [ids.tolist()]


@pytest.mark.parametrize("target", ["parent-is-a-file", "bin-is-a-directory", "idx-is-a-symlink", "prefix-ends-with-slash"])
def test_unusable_output_paths(workspace, tmp_path, capsys, target) -> None:
    source, prefix = workspace
    source.write_text(_lines({"text": "1"}))
    if target == "parent-is-a-file":
        (tmp_path / "afile").write_text("x")
        prefix, watched = str(tmp_path / "afile" / "corpus"), tmp_path / "afile"
    elif target == "bin-is-a-directory":
        prefix, watched = str(tmp_path / "other" / "p"), tmp_path / "other"
        (tmp_path / "other" / "p_text_document.bin").mkdir(parents=True)
        (tmp_path / "other" / "p_text_document.idx").write_bytes(b"old index")
    elif target == "idx-is-a-symlink":
        prefix, watched = str(tmp_path / "linked" / "p"), tmp_path / "linked"
        watched.mkdir()
        (watched / "p_text_document.bin").write_bytes(b"old")
        os.symlink("/etc/hostname", watched / "p_text_document.idx")
    else:
        prefix, watched = str(tmp_path / "out") + os.sep, tmp_path / "out"
    before = fingerprint(watched)
    assert main(_flags(str(source), prefix)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatron-preprocess-data: error:"), err
    assert fingerprint(watched) == before


def _fail_at(monkeypatch, step: str) -> None:
    """An OSError(ENOSPC) at one write step of the run."""
    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, f"No space left on device (simulated at {step})")

    if step == "temporary-directory":
        monkeypatch.setattr(module.tempfile, "mkdtemp", fail)
    elif step == "bin-write":
        real = IndexedDatasetBuilder.add_document
        count = [0]

        def add_document(self, *args, **kwargs):
            count[0] += 1
            if count[0] == 3:
                fail()
            return real(self, *args, **kwargs)

        monkeypatch.setattr(IndexedDatasetBuilder, "add_document", add_document)
    elif step == "idx-write":
        monkeypatch.setattr(IndexedDatasetBuilder, "finalize", fail)
    elif step == "fsync-before-publish":
        monkeypatch.setattr(module.os, "fsync", fail)
    elif step == "bin-rename":
        real_replace = os.replace

        def replace(src, dst):
            if dst.endswith(".bin"):
                fail()
            return real_replace(src, dst)

        monkeypatch.setattr(module.os, "replace", replace)


@pytest.mark.parametrize("step", ["temporary-directory", "bin-write", "idx-write", "fsync-before-publish"])
def test_interrupted_runs_leave_earlier_outputs_alone(workspace, monkeypatch, capsys, step) -> None:
    source, prefix = workspace
    source.write_text(_lines(*({"text": str(i)} for i in range(10))))
    out = os.path.dirname(prefix)
    before = fingerprint(out)
    _fail_at(monkeypatch, step)
    assert main(_flags(str(source), prefix)) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and err.count("\n") == 1
    assert fingerprint(out) == before
    assert _documents(prefix) == OLD


def test_interrupted_between_renames_never_pairs_new_bin_with_old_idx(workspace, monkeypatch) -> None:
    source, prefix = workspace
    source.write_text(_lines({"text": "8 8 8"}))
    _fail_at(monkeypatch, "bin-rename")
    assert main(_flags(str(source), prefix)) == 2
    # The old .idx went first; the old .bin is still there, and without its index nothing opens silently.
    assert not Path(prefix + "_text_document.idx").exists()
    with pytest.raises((OSError, ValueError)):
        IndexedDataset(prefix + "_text_document")
    assert [n for n in os.listdir(os.path.dirname(prefix)) if n.startswith(".")] == []


def test_argparse_errors_exit_2(capsys) -> None:
    for argv in (["--input", "x"], ["--input", "x", "--output-prefix", "p", "--tokenizer-type", "Nope", "--workers", "1"],
                 ["--input", "x", "--output-prefix", "p", "--tokenizer-type", "NullTokenizer", "--workers", "two"]):
        with pytest.raises(SystemExit) as caught:
            main(argv)
        assert caught.value.code == 2
    capsys.readouterr()
