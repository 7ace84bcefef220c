"""Input side of ``preprocess_data``: numbered records from JSONL or Parquet files, and their parsing.

A record is ``(number, payload)``: for JSONL the 1-based line number and the raw line's bytes (decoded
and parsed in the worker, so a malformed or non-UTF-8 line is reported with its number), for Parquet the 1-based row number and a
dict of the requested columns. Blank JSONL lines are ignored. Partitioning deals records round-robin
by number, as Megatron-LM's tool deals lines into its partition files. ``pyarrow`` (Parquet only) is
imported here, lazily, and nowhere else.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from types import ModuleType
from typing import Any

PARQUET_SUFFIXES = (".parquet", ".pq")


class BadRecordError(ValueError):
    """A record that cannot be used: malformed JSON, not an object, or a missing/non-string key."""


def _import_pyarrow_parquet() -> ModuleType:
    try:
        return importlib.import_module("pyarrow.parquet")
    except ImportError as error:
        raise ImportError("reading Parquet input needs the 'pyarrow' package: pip install pyarrow") from error


def is_parquet(path: str) -> bool:
    """True when ``path`` names a Parquet file (by suffix)."""
    return path.lower().endswith(PARQUET_SUFFIXES)


def read_records(
    path: str, json_keys: list[str], partition: int = 0, partitions: int = 1
) -> Iterator[tuple[int, bytes | dict[str, Any]]]:
    """Records of ``path`` whose ``(number - 1) % partitions == partition``."""
    if is_parquet(path):
        yield from _read_parquet(path, json_keys, partition, partitions)
        return
    with open(path, "rb") as stream:  # decoded per line, so a line that is not UTF-8 is reported by number
        for number, line in enumerate(stream, start=1):
            if (number - 1) % partitions == partition and line.strip():
                yield number, line


def _read_parquet(
    path: str, json_keys: list[str], partition: int, partitions: int
) -> Iterator[tuple[int, dict[str, Any]]]:
    parquet = _import_pyarrow_parquet()
    table = parquet.ParquetFile(path)
    missing = [key for key in json_keys if key not in table.schema_arrow.names]
    if missing:
        raise BadRecordError(f"{path}: Parquet columns {missing} not found (columns: {table.schema_arrow.names})")
    number = 0
    for batch in table.iter_batches(columns=json_keys):
        for row in batch.to_pylist():
            number += 1
            if (number - 1) % partitions == partition:
                yield number, row


def parse_record(payload: bytes | str | dict[str, Any], json_keys: list[str]) -> tuple[dict[str, str], int]:
    """The texts under ``json_keys`` and the payload's size in bytes; raises ``BadRecordError``."""
    if isinstance(payload, bytes):
        try:
            payload = payload.decode("utf-8")
        except UnicodeDecodeError as error:
            raise BadRecordError(f"not UTF-8 text (byte {error.start + 1} of the line); is the input binary?") from None
    if isinstance(payload, str):
        size = len(payload.encode("utf-8"))
        try:
            data = json.loads(payload)
        except json.JSONDecodeError as error:
            raise BadRecordError(f"malformed JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(data, dict):
            raise BadRecordError(f"expected a JSON object, got {type(data).__name__}")
    else:
        data, size = payload, 0
    texts = {}
    for key in json_keys:
        if key not in data:
            raise BadRecordError(f"no key {key!r} (keys: {sorted(data)}); check --json-keys")
        text = data[key]
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise BadRecordError(f"key {key!r} holds {type(text).__name__}, not a string")
        texts[key] = text
        if not isinstance(payload, str):
            size += len(text.encode("utf-8"))
    return texts, size
