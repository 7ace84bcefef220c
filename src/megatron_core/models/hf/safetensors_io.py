"""Reading and writing Hugging Face ``*.safetensors`` checkpoints, one slice or one tensor at a time.

:class:`HFCheckpointReader` opens a model directory (``model.safetensors`` or a sharded set
listed by ``model.safetensors.index.json``) and reads only the requested slice of a tensor
through ``safe_open(...).get_slice`` (memory-mapped; the file is unmapped after each read, so
resident memory stays near the slice). :class:`SafetensorsShardWriter` writes the safetensors
format itself, so a shard's header is written first and each tensor is streamed to its offset
as soon as it is produced (``safetensors.save_file`` would need the whole shard in memory).

The optional ``safetensors`` package (extras ``hf`` and ``dev``) is imported here only, lazily.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from typing import Any

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPE_CODES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class HFConversionError(ValueError):
    """A Hugging Face checkpoint or config cannot be converted; the message names the file and tensor."""


def import_safetensors() -> Any:
    """The ``safetensors`` package, or an ``ImportError`` naming the extra that installs it."""
    try:
        import safetensors  # noqa: F401
        from safetensors import safe_open  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "reading Hugging Face checkpoints needs the 'safetensors' package: pip install safetensors "
            "(or pip install 'megatron_core[hf]')"
        ) from error
    return safetensors


class HFCheckpointReader:
    """Tensor names, shapes and dtypes of an HF directory's safetensors files, and slice reads."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        index_path = os.path.join(self.directory, INDEX_FILE)
        single_path = os.path.join(self.directory, SINGLE_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise HFConversionError(f"{index_path}: not a safetensors index with a 'weight_map' ({e})") from e
            self.file_of: dict[str, str] = {str(k): str(v) for k, v in weight_map.items()}
            self._source = index_path
        elif os.path.isfile(single_path):
            self.file_of = dict.fromkeys(self._header(SINGLE_FILE), SINGLE_FILE)
            self._source = single_path
        else:
            raise HFConversionError(
                f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are read)"
            )
        missing = sorted({f for f in self.file_of.values() if not os.path.isfile(os.path.join(self.directory, f))})
        if missing:
            tensors = sorted(k for k, f in self.file_of.items() if f == missing[0])
            raise HFConversionError(
                f"{self._source} lists shard {os.path.join(self.directory, missing[0])}, which does not exist "
                f"(it should hold {len(tensors)} tensors, e.g. {tensors[:3]}); missing shards: {missing}"
            )
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for file_name in sorted(set(self.file_of.values())):
            header = self._header(file_name)
            for name, info in header.items():
                self._meta[name] = (tuple(info["shape"]), info["dtype"])
        absent = sorted(k for k in self.file_of if k not in self._meta)
        if absent:
            raise HFConversionError(
                f"{self._source} maps tensor {absent[0]!r} to {self.file_of[absent[0]]}, which does not contain it"
            )

    def _header(self, file_name: str) -> dict[str, Any]:
        path = os.path.join(self.directory, file_name)
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > 100_000_000:
                    raise ValueError(f"header length {length} is implausible")
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error) as e:
            raise HFConversionError(f"{path}: not a readable safetensors file ({e})") from e
        header.pop("__metadata__", None)
        return header

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return sorted(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor ``name``."""
        return self._meta[self._check(name)][0]

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of tensor ``name``."""
        code = self._meta[self._check(name)][1]
        if code not in _CODE_DTYPES:
            raise HFConversionError(f"{self.path_of(name)}: tensor {name!r} has unsupported dtype {code}")
        return _CODE_DTYPES[code]

    def path_of(self, name: str) -> str:
        """The file that holds tensor ``name``."""
        return os.path.join(self.directory, self.file_of[self._check(name)])

    def _check(self, name: str) -> str:
        if name not in self.file_of:
            raise HFConversionError(f"{self._source} has no tensor {name!r}")
        return name

    def read(self, name: str, index: Sequence[slice] | None = None) -> torch.Tensor:
        """Tensor ``name`` (or its slice ``index``, one ``slice`` per leading dimension) as a new CPU tensor."""
        path = self.path_of(name)
        safe_open = import_safetensors().safe_open
        try:
            with safe_open(path, framework="pt") as f:
                view = f.get_slice(name)
                # A slice is copied out of the mapping, so the tensor outlives the file; the file is unmapped at once.
                return view[tuple(index) if index is not None else tuple(slice(None) for _ in view.get_shape())].contiguous()
        except Exception as e:  # noqa: BLE001 - name the file and tensor of any read failure
            raise HFConversionError(f"reading tensor {name!r} from {path} failed: {type(e).__name__}: {e}") from e


def _header_bytes(entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[bytes, dict[str, int]]:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets: dict[str, int] = {}
    position = 0
    for name, shape, dtype in entries:
        if dtype not in _DTYPE_CODES:
            raise HFConversionError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
        size = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [position, position + size]}
        offsets[name] = position
        position += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


class SafetensorsShardWriter:
    """One safetensors file whose tensors (names, shapes, dtypes) are known before any data exists.

    The header is written on creation; :meth:`write` puts each tensor at its offset, in any order (or
    :meth:`write_row` one row of a tensor stacked along dim 0);
    :meth:`close` checks that every tensor was written and syncs the file to disk.
    """

    def __init__(self, path: str | os.PathLike, entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        self.path = os.fspath(path)
        self._entries = {name: (tuple(shape), dtype) for name, shape, dtype in entries}
        header, offsets = _header_bytes(entries)
        self._data_start = len(header)
        self._offsets = offsets
        self._written: set[str] = set()
        self._rows: dict[str, set[int]] = {}
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(header)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Store ``tensor`` (its shape and dtype must be the planned ones) at its place in the file."""
        self._put(name, tensor, None)
        self._written.add(name)

    def write_row(self, name: str, tensor: torch.Tensor, row: int) -> None:
        """Store row ``row`` (along dim 0) of a planned tensor; the tensor counts as written once every row is."""
        self._put(name, tensor, row)
        rows = self._rows.setdefault(name, set())
        rows.add(row)
        if len(rows) == self._entries[name][0][0]:
            self._written.add(name)

    def _put(self, name: str, tensor: torch.Tensor, row: int | None) -> None:
        shape, dtype = self._entries[name]
        want = shape if row is None else shape[1:]
        if tuple(tensor.shape) != want or tensor.dtype != dtype or (row is not None and not 0 <= row < shape[0]):
            where = "" if row is None else f" row {row}"
            raise HFConversionError(
                f"{self.path}: tensor {name!r}{where} is {tuple(tensor.shape)} {tensor.dtype}, planned {shape} {dtype}"
            )
        data = tensor.detach().to("cpu").contiguous()
        row_offset = 0 if row is None else row * data.numel() * data.element_size()
        self._file.seek(self._data_start + self._offsets[name] + row_offset)
        self._file.write(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")

    def close(self) -> None:
        """Check completeness, flush and fsync."""
        missing = sorted(set(self._entries) - self._written)
        if missing:
            self._file.close()
            raise HFConversionError(f"{self.path}: tensors never written: {missing[:5]}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def plan_shards(entries: list[tuple[str, tuple[int, ...], torch.dtype, int]], max_shard_bytes: int
                ) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """Group ``(name, shape, dtype, owner)`` entries into shards of at most ``max_shard_bytes`` each.

    A shard holds tensors of one owner only (the rank that writes it); order is kept.
    """
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = []
    owners: list[int] = []
    size = 0
    for name, shape, dtype, owner in entries:
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if not shards or owners[-1] != owner or (size + nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            owners.append(owner)
            size = 0
        shards[-1].append((name, tuple(shape), dtype))
        size += nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-0000i-of-0000n.safetensors``."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
