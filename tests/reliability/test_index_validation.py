"""``.idx`` interior entries are validated when an ``IndexedDataset`` opens (section 7, check 14 for data).

A corrupt sequence pointer, sequence length or document index used to return the next
document's tokens silently; each now raises a ``ValueError`` naming the file, the entry and the
value it must have.
"""

from __future__ import annotations

import struct

import numpy
import pytest
import torch

from megatron_core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

SEQUENCES = [[1, 2, 3], [4], [], [5, 6, 7, 8, 9], [10, 11]]  # int32: pointers 0, 12, 16, 16, 36
DOCUMENT_ENDS = [2, 3, 5]
HEADER, COUNT = 34, len(SEQUENCES)
LENGTHS_AT, POINTERS_AT = HEADER, HEADER + 4 * COUNT
DOCS_AT = POINTERS_AT + 8 * COUNT


def _write(prefix: str) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for index, sequence in enumerate(SEQUENCES):
        builder.add_item(torch.tensor(sequence))
        if index + 1 in DOCUMENT_ENDS:
            builder.end_document()
    builder.finalize(prefix + ".idx")


def _patch(path: str, offset: int, data: bytes) -> None:
    raw = bytearray(open(path, "rb").read())
    raw[offset:offset + len(data)] = data
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize("offset, value, message", [
    (POINTERS_AT + 8 * 3, struct.pack("<q", 20),
     "sequence 3 starts at byte 20, but sequence 2 starts at byte 16 with 0 tokens of 4 bytes, so sequence 3 "
     "must start at byte 16"),
    (LENGTHS_AT + 4 * 1, struct.pack("<i", 2), "sequence 2 starts at byte 16, but sequence 1 starts at byte 12 "
     "with 2 tokens"),
    (POINTERS_AT, struct.pack("<q", 4), "the first sequence pointer is 4, expected 0"),
    (DOCS_AT + 8 * 2, struct.pack("<q", 1), "document index 2 (1) is smaller than document index 1 (2)"),
], ids=["pointer", "length", "first_pointer", "document_index"])
def test_corrupt_interior_entry_is_named(tmp_path, offset: int, value: bytes, message: str) -> None:
    prefix = str(tmp_path / "data")
    _write(prefix)
    assert IndexedDataset(prefix)[3].tolist() == [5, 6, 7, 8, 9]
    _patch(prefix + ".idx", offset, value)
    with pytest.raises(ValueError, match="corrupt index") as info:
        IndexedDataset(prefix)
    assert message in str(info.value) and prefix + ".idx" in str(info.value)
