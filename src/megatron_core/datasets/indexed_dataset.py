"""Megatron's ``.bin``/``.idx`` token storage: ``IndexedDataset`` (reader) and ``IndexedDatasetBuilder``.

Byte-for-byte the format of ``megatron.core.datasets.indexed_dataset`` (all little-endian):

* ``<prefix>.bin``: every sequence's tokens back to back in the index dtype, no header.
* ``<prefix>.idx``: magic ``MMIDIDX\\x00\\x00``, ``<Q`` version 1, ``<B`` dtype code, ``<Q`` sequence
  count S, ``<Q`` document-boundary count D+1, then int32 lengths[S], int64 byte pointers[S], int64
  document indices[D+1] (``[0, ..., S]``) and, for multimodal data only, int8 modes[S]. Nothing in
  the file says whether modes are present: the reader is told (``multimodal=True``).

Unlike Megatron, opening validates the header and the sizes and raises ``ValueError`` naming the
file and the problem (bad magic, unknown version or dtype code, truncated index, ``.bin`` shorter
than the index says) instead of failing later with an opaque error.

A prefix may also be ``s3://...`` or ``msc://...`` with an ``ObjectStorageConfig``: the ``.idx`` is
cached locally (``datasets.object_storage_utils``) and the ``.bin`` read by the ranged readers of
``OBJECT_STORAGE_BIN_READERS`` (``datasets.object_storage_bin_readers``).
"""

from __future__ import annotations

import os
import shutil
import struct
from enum import Enum
from typing import Any

import numpy

from megatron_core.datasets.object_storage_bin_readers import (  # the reader classes: Megatron's names here
    OBJECT_STORAGE_BIN_READERS,
    _MultiStorageClientBinReader,  # noqa: F401
    _S3BinReader,  # noqa: F401
)
from megatron_core.datasets.object_storage_utils import (
    ObjectStorageConfig,
    S3Config,
    cache_index_file,
    dataset_exists,
    get_index_cache_path,
    get_object_storage_access,
    is_object_storage_path,
)

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER_SIZE = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8


class DType(Enum):
    """Token dtype codes stored in the ``.idx`` header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: Any) -> int:
        """The code of a numpy dtype (class or instance)."""
        name = numpy.dtype(value).name
        if name not in cls.__members__:
            raise ValueError(f"dtype {name} cannot be stored; supported: {list(cls.__members__)}")
        return cls[name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> type:
        """The numpy dtype class of a code."""
        return getattr(numpy, cls(value).name)

    @staticmethod
    def size(key: Any) -> int:
        """Bytes per element of a code or a dtype."""
        if isinstance(key, (int, numpy.integer)) and not isinstance(key, bool):
            return numpy.dtype(DType.dtype_from_code(int(key))).itemsize
        return numpy.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: int | None) -> type:
        """uint16 when fewer than 65500 distinct values must be stored, else int32 (Megatron's rule)."""
        if cardinality is not None and cardinality < 65500:
            return numpy.uint16
        return numpy.int32


def get_idx_path(path_prefix: str) -> str:
    """``<prefix>.idx``."""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """``<prefix>.bin``."""
    return path_prefix + ".bin"


_CHECK_CHUNK = 1 << 22


def _check_index_arrays(idx_path: str, lengths: numpy.ndarray, pointers: numpy.ndarray, doc: numpy.ndarray,
                        dtype_size: int) -> None:
    """Document indices never decrease; sequences are stored back to back (pointer ``i + 1`` is
    pointer ``i`` plus length ``i`` times the token size, starting at 0). Checked in chunks."""
    for start in range(0, len(doc) - 1, _CHECK_CHUNK):
        part = doc[start:start + _CHECK_CHUNK + 1]
        bad = numpy.flatnonzero(part[1:] < part[:-1])
        if bad.size:
            i = start + int(bad[0])
            raise ValueError(f"{idx_path}: corrupt index: document index {i + 1} ({int(doc[i + 1])}) is smaller "
                             f"than document index {i} ({int(doc[i])}); document indices must not decrease")
    if len(pointers) and int(pointers[0]) != 0:
        raise ValueError(f"{idx_path}: corrupt index: the first sequence pointer is {int(pointers[0])}, expected 0")
    for start in range(0, len(pointers) - 1, _CHECK_CHUNK):
        ptr = pointers[start:start + _CHECK_CHUNK + 1].astype(numpy.int64)
        expected = ptr[:-1] + lengths[start:start + len(ptr) - 1].astype(numpy.int64) * dtype_size
        bad = numpy.flatnonzero(ptr[1:] != expected)
        if bad.size:
            i = start + int(bad[0])
            raise ValueError(
                f"{idx_path}: corrupt index: sequence {i + 1} starts at byte {int(pointers[i + 1])}, but sequence "
                f"{i} starts at byte {int(pointers[i])} with {int(lengths[i])} tokens of {dtype_size} bytes, so "
                f"sequence {i + 1} must start at byte {int(expected[bad[0]])}")


class _IndexReader:
    """Parses and validates an ``.idx`` file; the arrays are read-only views of a memory map."""

    def __init__(self, idx_path: str, multimodal: bool) -> None:
        if not os.path.isfile(idx_path):
            raise FileNotFoundError(f"index file not found: {idx_path}")
        file_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            header = stream.read(_HEADER_SIZE)
        if len(header) < _HEADER_SIZE:
            raise ValueError(
                f"{idx_path}: truncated header ({len(header)} bytes, a Megatron index needs {_HEADER_SIZE})"
            )
        if header[:9] != _INDEX_HEADER:
            raise ValueError(f"{idx_path}: bad magic {header[:9]!r}, expected {_INDEX_HEADER!r}")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != 1:
            raise ValueError(f"{idx_path}: unknown index version {version} (only version 1 exists)")
        code = header[17]
        if code not in {member.value for member in DType}:
            valid = {member.value: member.name for member in DType}
            raise ValueError(f"{idx_path}: unknown dtype code {code}; valid codes are {valid}")
        self.dtype = DType.dtype_from_code(code)
        self.dtype_size = DType.size(code)
        self.sequence_count, self.document_count = struct.unpack("<QQ", header[18:34])
        count = self.sequence_count
        needed = _HEADER_SIZE + 12 * count + 8 * self.document_count + (count if multimodal else 0)
        if file_size < needed:
            raise ValueError(
                f"{idx_path}: truncated index: the header declares {count} sequences and "
                f"{self.document_count} document boundaries{' with modes' if multimodal else ''}, which "
                f"need {needed} bytes, but the file has {file_size}"
            )
        self._mmap = numpy.memmap(idx_path, mode="r", order="C")
        buffer = memoryview(self._mmap)
        offset = _HEADER_SIZE
        self.sequence_lengths = numpy.frombuffer(buffer, dtype=numpy.int32, count=count, offset=offset)
        offset += 4 * count
        self.sequence_pointers = numpy.frombuffer(buffer, dtype=numpy.int64, count=count, offset=offset)
        offset += 8 * count
        self.document_indices = numpy.frombuffer(
            buffer, dtype=numpy.int64, count=self.document_count, offset=offset
        )
        offset += 8 * self.document_count
        self.sequence_modes = (
            numpy.frombuffer(buffer, dtype=numpy.int8, count=count, offset=offset) if multimodal else None
        )
        self._validate(idx_path)

    def _validate(self, idx_path: str) -> None:
        doc = self.document_indices
        if self.document_count == 0 or doc[0] != 0 or doc[-1] != self.sequence_count:
            first = int(doc[0]) if self.document_count else None
            last = int(doc[-1]) if self.document_count else None
            raise ValueError(
                f"{idx_path}: corrupt document indices: they must run from 0 to the sequence count "
                f"{self.sequence_count}, found first={first} last={last} ({self.document_count} entries)"
            )
        if self.sequence_count and bool((self.sequence_lengths < 0).any()):
            raise ValueError(f"{idx_path}: corrupt index: negative sequence lengths")
        _check_index_arrays(idx_path, self.sequence_lengths, self.sequence_pointers, doc, self.dtype_size)

    def close(self) -> None:
        """Release the memory map (arrays handed out earlier must no longer be used)."""
        mmap = getattr(self, "_mmap", None)
        if mmap is not None and getattr(mmap, "_mmap", None) is not None:
            mmap._mmap.close()
        self._mmap = None

    def __len__(self) -> int:
        return self.sequence_count


class _MMapBinReader:
    """Reads token runs from a memory-mapped ``.bin``."""

    def __init__(self, bin_path: str) -> None:
        self._mmap = numpy.memmap(bin_path, mode="r", order="C") if os.path.getsize(bin_path) else None

    def read(self, dtype: type, count: int, offset: int) -> numpy.ndarray:
        if count == 0 or self._mmap is None:
            return numpy.empty(0, dtype=dtype)
        return numpy.frombuffer(memoryview(self._mmap), dtype=dtype, count=count, offset=offset)

    def close(self) -> None:
        if self._mmap is not None and getattr(self._mmap, "_mmap", None) is not None:
            self._mmap._mmap.close()
        self._mmap = None


class _FileBinReader:
    """Reads token runs with ``seek``/``readinto`` (``mmap=False``)."""

    def __init__(self, bin_path: str) -> None:
        self._bin_path = bin_path

    def read(self, dtype: type, count: int, offset: int) -> numpy.ndarray:
        sequence = numpy.empty(count, dtype=dtype)
        with open(self._bin_path, mode="rb", buffering=0) as stream:
            stream.seek(offset)
            got = stream.readinto(sequence)
        if got != sequence.nbytes:
            raise ValueError(f"{self._bin_path}: short read at byte {offset} ({got} of {sequence.nbytes})")
        return sequence

    def close(self) -> None:
        pass


class IndexedDataset:
    """Read-only view of a ``<prefix>.bin``/``<prefix>.idx`` pair; item ``i`` is sequence ``i``.

    ``multimodal=True`` also reads the per-sequence modes and makes items ``(tokens, mode)``.
    ``mmap=False`` reads with file calls instead of a memory map. For an ``s3://`` / ``msc://``
    prefix pass ``object_storage_config`` (or Megatron's deprecated ``s3_config``) and
    ``mmap=False``: the ``.idx`` is downloaded to ``path_to_idx_cache`` by global rank 0 and the
    ``.bin`` streamed in ``bin_chunk_nbytes`` ranged requests.
    """

    def __init__(
        self,
        path_prefix: str,
        multimodal: bool = False,
        mmap: bool = True,
        object_storage_config: ObjectStorageConfig | None = None,
        s3_config: S3Config | None = None,
        fast_cache_load: bool = False,
        sequences_per_dataset: tuple[int, int] | None = None,
        dtype_code: int | None = None,
    ) -> None:
        object_storage_config = object_storage_config or s3_config
        remote = is_object_storage_path(path_prefix)
        if remote and object_storage_config is None:
            raise ValueError(
                f"IndexedDataset {path_prefix!r} is on object storage: object_storage_config (path_to_idx_cache) "
                "is required"
            )
        if not remote and object_storage_config is not None:
            raise ValueError(
                f"IndexedDataset {path_prefix!r}: object_storage_config is only for s3:// or msc:// prefixes"
            )
        if remote and mmap:
            raise ValueError(f"IndexedDataset {path_prefix!r}: mmap (True) must be False for object storage")
        if remote:
            idx_path = get_idx_path(path_prefix)
            cache_index_file(idx_path, get_index_cache_path(idx_path, object_storage_config))
        self.initialize(
            path_prefix, multimodal, mmap, object_storage_config, fast_cache_load, sequences_per_dataset, dtype_code
        )

    def initialize(
        self,
        path_prefix: str,
        multimodal: bool,
        mmap: bool,
        object_storage_config: ObjectStorageConfig | None = None,
        fast_cache_load: bool = False,
        sequences_per_dataset: tuple[int, int] | None = None,
        dtype_code: int | None = None,
    ) -> None:
        """Open the files (called by ``__init__`` and after unpickling; a remote ``.idx`` is already cached)."""
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        if object_storage_config is not None:
            idx_path = get_index_cache_path(idx_path, object_storage_config)
            bin_reader: Any = OBJECT_STORAGE_BIN_READERS[get_object_storage_access(path_prefix)](
                bin_path, object_storage_config
            )
        else:
            for path in (idx_path, bin_path):
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"IndexedDataset {path_prefix!r}: missing file {path}")
            bin_reader = None
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self.object_storage_config = object_storage_config
        self.fast_cache_load = fast_cache_load
        self.sequences_per_dataset = sequences_per_dataset
        self.dtype_code = dtype_code
        self.index = _IndexReader(idx_path, multimodal)
        if dtype_code is not None and DType.code_from_dtype(self.index.dtype) != dtype_code:
            raise ValueError(
                f"{idx_path}: stores dtype {numpy.dtype(self.index.dtype).name}, but dtype code {dtype_code} "
                f"({DType(dtype_code).name}) was expected"
            )
        if sequences_per_dataset is not None and tuple(sequences_per_dataset) != (
            self.index.sequence_count,
            self.index.document_count,
        ):
            raise ValueError(
                f"{idx_path}: holds {self.index.sequence_count} sequences and {self.index.document_count} "
                f"document boundaries, but sequences_per_dataset says {tuple(sequences_per_dataset)}"
            )
        bin_size = os.path.getsize(bin_path) if bin_reader is None else bin_reader.nbytes
        if self.index.sequence_count:
            needed = int(self.index.sequence_pointers[-1]) + int(self.index.sequence_lengths[-1]) * (
                self.index.dtype_size
            )
            if bin_size < needed:
                raise ValueError(
                    f"{bin_path}: data file is shorter than its index says: {bin_size} bytes, but the "
                    f"last sequence ends at byte {needed}"
                )
        if bin_reader is None:
            bin_reader = _MMapBinReader(bin_path) if mmap else _FileBinReader(bin_path)
        self.bin_reader = bin_reader

    def __getstate__(self) -> tuple:
        return (
            self.path_prefix,
            self.multimodal,
            self.mmap,
            self.object_storage_config,
            self.fast_cache_load,
            self.sequences_per_dataset,
            self.dtype_code,
        )

    def __setstate__(self, state: tuple) -> None:
        self.initialize(*state)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: int | numpy.integer | slice) -> Any:
        """Sequence ``idx`` (an array), or a list of arrays for a contiguous slice."""
        if isinstance(idx, (int, numpy.integer)):
            return self.get(idx)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("Slices into indexed_dataset must be contiguous")
            lengths = self.index.sequence_lengths[start:stop]
            if len(lengths) == 0:
                sequences: list = []
            else:
                tokens = self.bin_reader.read(
                    self.index.dtype, int(lengths.sum()), int(self.index.sequence_pointers[start])
                )
                sequences = numpy.split(tokens, numpy.cumsum(lengths)[:-1])
            if self.multimodal:
                return sequences, self.index.sequence_modes[start:stop]
            return sequences
        raise TypeError(f"Unexpected type received for idx: {type(idx)}")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> Any:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when ``length`` is None)."""
        count = len(self)
        if not -count <= idx < count:
            raise IndexError(f"sequence index {idx} out of range for {self.path_prefix} ({count} sequences)")
        sequence_length = int(self.index.sequence_lengths[idx])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of length "
                f"{sequence_length} in {self.path_prefix}"
            )
        pointer = int(self.index.sequence_pointers[idx]) + offset * self.index.dtype_size
        sequence = self.bin_reader.read(self.index.dtype, int(length), pointer)
        if self.multimodal:
            return sequence, self.index.sequence_modes[idx]
        return sequence

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        """int32 tokens per sequence."""
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> numpy.ndarray:
        """int64 sequence boundaries of the documents, ``[0, ..., len(self)]``."""
        return self.index.document_indices

    def get_document_indices(self) -> numpy.ndarray:
        """Same as :attr:`document_indices` (Megatron's older accessor)."""
        return self.index.document_indices

    def set_document_indices(self, document_indices: numpy.ndarray) -> None:
        """Replace the document indices in memory (the file is not changed)."""
        self.index.document_indices = document_indices

    @property
    def sequence_modes(self) -> numpy.ndarray:
        """int8 mode per sequence; only for datasets opened with ``multimodal=True``."""
        if self.index.sequence_modes is None:
            raise ValueError(f"{self.path_prefix} was opened without multimodal=True: it has no sequence modes")
        return self.index.sequence_modes

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """True when both ``<prefix>.idx`` and ``<prefix>.bin`` exist (locally or on object storage)."""
        if is_object_storage_path(path_prefix):
            return dataset_exists(path_prefix, get_idx_path(path_prefix), get_bin_path(path_prefix))
        return os.path.exists(get_idx_path(path_prefix)) and os.path.exists(get_bin_path(path_prefix))


def _write_index(
    idx_path: str,
    dtype: type,
    sequence_lengths: list[int] | numpy.ndarray,
    sequence_modes: list[int] | None,
    document_indices: list[int] | numpy.ndarray,
) -> None:
    lengths = numpy.asarray(sequence_lengths, dtype=numpy.int64)
    pointers = numpy.zeros(len(lengths), dtype=numpy.int64)
    if len(lengths) > 1:
        numpy.cumsum(lengths[:-1] * DType.size(dtype), out=pointers[1:])
    with open(idx_path, "wb") as writer:
        writer.write(_INDEX_HEADER)
        writer.write(struct.pack("<Q", 1))
        writer.write(struct.pack("<B", DType.code_from_dtype(dtype)))
        writer.write(struct.pack("<Q", len(lengths)))
        writer.write(struct.pack("<Q", len(document_indices)))
        writer.write(lengths.astype(numpy.int32).tobytes(order="C"))
        writer.write(pointers.tobytes(order="C"))
        writer.write(numpy.asarray(document_indices, dtype=numpy.int64).tobytes(order="C"))
        if sequence_modes is not None:
            writer.write(numpy.asarray(sequence_modes, dtype=numpy.int8).tobytes(order="C"))


class IndexedDatasetBuilder:
    """Writes a ``.bin`` incrementally and the matching ``.idx`` on :meth:`finalize`."""

    def __init__(self, bin_path: str, dtype: type = numpy.int32, multimodal: bool = False) -> None:
        DType.code_from_dtype(dtype)
        self.data_file = open(bin_path, "wb")  # noqa: SIM115 - closed in finalize
        self.bin_path = bin_path
        self.dtype = dtype
        self.multimodal = multimodal
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.sequence_modes: list[int] | None = [] if multimodal else None

    def _as_array(self, tokens: Any) -> numpy.ndarray:
        if hasattr(tokens, "detach"):
            tokens = tokens.detach().cpu().numpy()
        return numpy.asarray(tokens, dtype=self.dtype)

    def add_item(self, tensor: Any, mode: int = 0) -> None:
        """Append one sequence (a tensor, array or list of token ids)."""
        array = self._as_array(tensor)
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))
        if self.sequence_modes is not None:
            self.sequence_modes.append(mode)

    def add_document(self, tensor: Any, lengths: list[int], modes: list[int] | None = None) -> None:
        """Append a whole document: its tokens and the lengths of its sequences."""
        array = self._as_array(tensor)
        if int(sum(lengths)) != array.size:
            raise ValueError(f"add_document: lengths sum to {int(sum(lengths))} but the document has {array.size} tokens")
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(int(length) for length in lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.sequence_modes is not None:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def end_document(self) -> None:
        """Close the current document (after one or more :meth:`add_item` calls)."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every sequence and document of the dataset at ``path_prefix`` (same dtype)."""
        index = _IndexReader(get_idx_path(path_prefix), multimodal=self.multimodal)
        try:
            if numpy.dtype(index.dtype) != numpy.dtype(self.dtype):
                raise ValueError(
                    f"add_index: {path_prefix} stores {numpy.dtype(index.dtype).name}, this builder writes "
                    f"{numpy.dtype(self.dtype).name}"
                )
            offset = len(self.sequence_lengths)
            self.sequence_lengths.extend(index.sequence_lengths.tolist())
            self.document_indices.extend((offset + index.document_indices[1:]).tolist())
            if self.sequence_modes is not None:
                self.sequence_modes.extend(index.sequence_modes.tolist())
        finally:
            index.close()
        with open(get_bin_path(path_prefix), "rb") as stream:
            shutil.copyfileobj(stream, self.data_file)

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin`` and write the index to ``idx_path``."""
        self.data_file.close()
        _write_index(idx_path, self.dtype, self.sequence_lengths, self.sequence_modes, self.document_indices)
