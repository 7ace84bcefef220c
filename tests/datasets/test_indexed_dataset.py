"""IndexedDataset / IndexedDatasetBuilder: format, byte-identity with megatron-core, validation errors."""

from __future__ import annotations

import pickle
import struct

import numpy
import pytest
import torch

from megatron_core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

SEQUENCES = [[1, 2, 3], [4], [], [5, 6, 7, 8, 9], [10, 11]]
DOCUMENT_ENDS = [2, 3, 5]  # documents: seq 0-1, seq 2, seq 3-4


def _write(builder_cls, prefix: str, dtype=numpy.int32, multimodal: bool = False) -> None:
    builder = builder_cls(prefix + ".bin", dtype=dtype, multimodal=multimodal)
    for index, sequence in enumerate(SEQUENCES):
        if multimodal:
            builder.add_item(torch.tensor(sequence, dtype=torch.int64), mode=index % 3)
        else:
            builder.add_item(torch.tensor(sequence, dtype=torch.int64))
        if index + 1 in DOCUMENT_ENDS:
            builder.end_document()
    builder.finalize(prefix + ".idx")


def test_layout_and_reading(tmp_path):
    prefix = str(tmp_path / "d")
    _write(IndexedDatasetBuilder, prefix, numpy.uint16)
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, DType.uint16.value, 5, 4)
    lengths = numpy.frombuffer(raw, numpy.int32, 5, 34)
    pointers = numpy.frombuffer(raw, numpy.int64, 5, 34 + 20)
    documents = numpy.frombuffer(raw, numpy.int64, 4, 34 + 60)
    assert lengths.tolist() == [3, 1, 0, 5, 2]
    assert pointers.tolist() == [0, 6, 8, 8, 18]
    assert documents.tolist() == [0, 2, 3, 5]
    assert len(raw) == 34 + 60 + 32
    assert open(prefix + ".bin", "rb").read() == numpy.array(sum(SEQUENCES, []), numpy.uint16).tobytes()

    for mmap in (True, False):
        dataset = IndexedDataset(prefix, mmap=mmap)
        assert len(dataset) == 5
        assert [dataset[i].tolist() for i in range(5)] == SEQUENCES
        assert dataset[3].dtype == numpy.uint16
        assert [s.tolist() for s in dataset[1:4]] == SEQUENCES[1:4]
        assert dataset.get(3, offset=1, length=3).tolist() == [6, 7, 8]
        assert dataset.get(3, offset=2).tolist() == [7, 8, 9]
        assert dataset.document_indices.tolist() == [0, 2, 3, 5]
        assert dataset.sequence_lengths.tolist() == [3, 1, 0, 5, 2]
        with pytest.raises(ValueError, match="contiguous"):
            dataset[0:4:2]
        with pytest.raises(IndexError):
            dataset.get(0, offset=2, length=5)
        clone = pickle.loads(pickle.dumps(dataset))
        assert clone[4].tolist() == [10, 11]
    assert IndexedDataset.exists(prefix) and not IndexedDataset.exists(prefix + "x")


def test_multimodal_add_document_and_add_index(tmp_path):
    prefix = str(tmp_path / "m")
    _write(IndexedDatasetBuilder, prefix, numpy.int64, multimodal=True)
    dataset = IndexedDataset(prefix, multimodal=True)
    tokens, mode = dataset[3]
    assert tokens.tolist() == SEQUENCES[3] and mode == 0
    assert dataset.sequence_modes.tolist() == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="multimodal"):
        _ = IndexedDataset(prefix).sequence_modes

    other = str(tmp_path / "o")
    builder = IndexedDatasetBuilder(other + ".bin", dtype=numpy.int32)
    builder.add_document([7, 8, 9, 10], lengths=[1, 3])
    builder.finalize(other + ".idx")
    first = str(tmp_path / "f")
    _write(IndexedDatasetBuilder, first, numpy.int32)
    merged = str(tmp_path / "merged")
    builder = IndexedDatasetBuilder(merged + ".bin", dtype=numpy.int32)
    builder.add_index(first)
    builder.add_index(other)
    builder.finalize(merged + ".idx")
    dataset = IndexedDataset(merged)
    assert [dataset[i].tolist() for i in range(len(dataset))] == SEQUENCES + [[7], [8, 9, 10]]
    assert dataset.document_indices.tolist() == [0, 2, 3, 5, 7]
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=numpy.uint16)
    with pytest.raises(ValueError, match="stores int32"):
        builder.add_index(first)


@pytest.mark.parametrize("dtype", [numpy.uint16, numpy.int32, numpy.int64, numpy.float32])
def test_byte_identical_with_megatron(tmp_path, mcore, dtype):
    from megatron.core.datasets import indexed_dataset as reference

    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    _write(IndexedDatasetBuilder, ours, dtype)
    _write(reference.IndexedDatasetBuilder, theirs, dtype)
    for suffix in (".bin", ".idx"):
        assert open(ours + suffix, "rb").read() == open(theirs + suffix, "rb").read()
    for reader_cls in (IndexedDataset, reference.IndexedDataset):
        for prefix in (ours, theirs):
            dataset = reader_cls(prefix)
            assert [dataset[i].tolist() for i in range(len(dataset))] == SEQUENCES
            assert dataset.document_indices.tolist() == [0, 2, 3, 5]


def test_megatron_multimodal_files_read_identically(tmp_path, mcore):
    from megatron.core.datasets import indexed_dataset as reference

    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    _write(IndexedDatasetBuilder, ours, numpy.int32, multimodal=True)
    _write(reference.IndexedDatasetBuilder, theirs, numpy.int32, multimodal=True)
    assert open(ours + ".idx", "rb").read() == open(theirs + ".idx", "rb").read()
    ref = reference.IndexedDataset(ours, multimodal=True)
    mine = IndexedDataset(theirs, multimodal=True)
    for i in range(len(SEQUENCES)):
        assert ref[i][0].tolist() == mine[i][0].tolist() and ref[i][1] == mine[i][1]


def _corrupt(tmp_path, edit) -> str:
    prefix = str(tmp_path / "c")
    _write(IndexedDatasetBuilder, prefix, numpy.int32)
    edit(prefix)
    return prefix


def _patch(path: str, offset: int, data: bytes) -> None:
    raw = bytearray(open(path, "rb").read())
    raw[offset : offset + len(data)] = data
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: _patch(p + ".idx", 0, b"XXIDIDX"), "bad magic"),
        (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), "unknown index version 2"),
        (lambda p: _patch(p + ".idx", 17, bytes([9])), "unknown dtype code 9"),
        (lambda p: open(p + ".idx", "r+b").truncate(20), "truncated header"),
        (lambda p: open(p + ".idx", "r+b").truncate(60), "truncated index"),
        (lambda p: _patch(p + ".idx", 26, struct.pack("<Q", 3)), "corrupt document indices"),
        (lambda p: open(p + ".bin", "r+b").truncate(30), "shorter than its index says"),
    ],
)
def test_corrupt_files_raise_clear_errors(tmp_path, edit, message):
    prefix = _corrupt(tmp_path, edit)
    with pytest.raises(ValueError, match=message) as info:
        IndexedDataset(prefix)
    assert str(tmp_path) in str(info.value)


def test_missing_files(tmp_path):
    prefix = _corrupt(tmp_path, lambda p: __import__("os").remove(p + ".bin"))
    with pytest.raises(FileNotFoundError, match=r"c\.bin"):
        IndexedDataset(prefix)


def test_dtype_codes():
    assert [DType.code_from_dtype(d) for d in (numpy.uint8, numpy.int32, numpy.uint16)] == [1, 4, 8]
    assert DType.dtype_from_code(6) is numpy.float64
    assert DType.size(8) == 2 and DType.size(numpy.int64) == 8
    assert DType.optimal_dtype(65499) is numpy.uint16 and DType.optimal_dtype(65500) is numpy.int32
    with pytest.raises(ValueError, match="cannot be stored"):
        DType.code_from_dtype(numpy.complex64)
