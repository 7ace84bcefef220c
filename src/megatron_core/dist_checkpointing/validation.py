"""Checks run before writing or reading anything (Megatron-Core ``dist_checkpointing.validation``).

Save: :func:`validate_sharding_integrity` gathers every rank's shard descriptions and checks that
the main replicas tile each global tensor exactly once (no gap, no overlap), that all ranks agree
on shape and dtype, and that every replica matches a main shard. Load: :func:`check_load_requests`
checks every requested key against the checkpoint metadata (existence, kind, global shape) so a
mismatch is reported with the key and both shapes before any tensor is touched.

Strict loading (Megatron-Core's helpers, collective-free): :func:`validate_integrity_and_strict_load` finds
the keys a load misses or does not expect from metadata already gathered, drops the unexpected ones
(:func:`adjust_non_strict_load`) and reports both as ``strict`` says
(:func:`maybe_report_missing_and_unexpected_keys`).

Integrity (Megatron-Core 0.19): :func:`save_integrity_manifest` writes ``integrity.json`` (the SHA-256
of every file) and :func:`verify_integrity_manifest` checks it (``save``/``load`` with ``verify_integrity``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections import defaultdict
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.core import (
    CheckpointingException,
    atomic_write_text,
    check_is_distributed_checkpoint,
)
from megatron_core.dist_checkpointing.dict_utils import diff, extract_matching_values, nested_values
from megatron_core.dist_checkpointing.mapping import (
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)
from megatron_core.dist_checkpointing.save_target import IN_PROGRESS_MARKER

logger = logging.getLogger(__name__)

INTEGRITY_FNAME = "integrity.json"
HASH_ALGORITHM = "sha256"
_READ_CHUNK = 1 << 20


class StrictHandling(Enum):
    """What ``load`` does with keys missing from the checkpoint or unexpected in it.

    Missing keys (requested but not saved) raise unless the mode is ``log_all``, ``return_all`` or
    ``ignore_all``, which drop them from the result. Unexpected keys (saved but requested by no
    rank) are ignored, logged, raised or returned as the mode's name says.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: StrictHandling) -> bool:
        """Whether unexpected keys must be computed (a gather of every rank's requested keys)."""
        return val not in (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.IGNORE_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: StrictHandling) -> bool:
        """Whether ``load`` returns ``(state_dict, missing_keys, unexpected_keys)``."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)

    @staticmethod
    def tolerates_missing_keys(val: StrictHandling) -> bool:
        """Whether requested keys absent from the checkpoint are dropped instead of raising."""
        return val in (StrictHandling.LOG_ALL, StrictHandling.RETURN_ALL, StrictHandling.IGNORE_ALL)


def parse_strict_flag(strict: str | StrictHandling) -> StrictHandling:
    """``StrictHandling`` from an enum value or its string name."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except ValueError as e:
        valid = ", ".join(s.value for s in StrictHandling)
        raise ValueError(f"strict={strict!r} is not one of: {valid}") from e


def _shard_record(sh: ShardedBase) -> tuple:
    if isinstance(sh, ShardedTensor):
        return ("t", sh.key, tuple(sh.global_shape), str(sh.dtype), tuple(sh.global_offset),
                tuple(sh.chunk_sizes()), is_main_replica(sh.replica_id))
    if isinstance(sh, ShardedObject):
        return ("o", sh.key, tuple(sh.global_shape), None, tuple(sh.global_offset), None,
                is_main_replica(sh.replica_id))
    raise CheckpointingException(f"unexpected sharded leaf {type(sh).__name__} for key {sh.key!r}")


def _overlaps(a: tuple, b: tuple) -> bool:
    (oa, sa), (ob, sb) = a, b
    return all(x < y + ly and y < x + lx for x, lx, y, ly in zip(oa, sa, ob, sb))


def _check_tensor_key(key: str, records: list[tuple]) -> list[str]:
    errors = []
    shapes = {r[2] for r in records}
    dtypes = {r[3] for r in records}
    if len(shapes) > 1:
        errors.append(f"{key!r}: ranks disagree on global_shape: {sorted(shapes)}")
    if len(dtypes) > 1:
        errors.append(f"{key!r}: ranks disagree on dtype: {sorted(dtypes)}")
    if errors:
        return errors
    main_records = [(r[4], r[5]) for r in records if r[6]]
    main = sorted(set(main_records))
    for shard in main:
        count = main_records.count(shard)
        if count > 1:
            errors.append(f"{key!r}: shard at offset {shard[0]} size {shard[1]} has {count} main replicas "
                          "(replica_id 0 on more than one rank)")
    replicas = {(r[4], r[5]) for r in records}
    global_shape = records[0][2]
    for i in range(len(main)):
        for j in range(i + 1, len(main)):
            if _overlaps(main[i], main[j]):
                errors.append(f"{key!r}: main-replica shards overlap: offset {main[i][0]} size {main[i][1]} and "
                              f"offset {main[j][0]} size {main[j][1]}")
    covered = sum(math.prod(size) for _, size in main)
    if not errors and covered != math.prod(global_shape):
        errors.append(f"{key!r}: main-replica shards cover {covered} of {math.prod(global_shape)} elements of "
                      f"global_shape {global_shape} (a shard is missing or no rank has replica_id 0 for it)")
    stray = replicas - set(main)
    if stray:
        errors.append(f"{key!r}: replica shards {sorted(stray)[:3]} match no main-replica shard")
    return errors


def _check_object_key(key: str, records: list[tuple]) -> list[str]:
    shapes = {r[2] for r in records}
    if len(shapes) > 1:
        return [f"ShardedObject {key!r}: ranks disagree on the grid shape: {sorted(shapes)}"]
    main_offsets = [r[4] for r in records if r[6]]
    errors = []
    duplicated = {o for o in main_offsets if main_offsets.count(o) > 1}
    if duplicated:
        errors.append(f"ShardedObject {key!r}: shards {sorted(duplicated)} have more than one main replica")
    expected = math.prod(next(iter(shapes)))
    if len(set(main_offsets)) != expected:
        errors.append(f"ShardedObject {key!r}: {len(set(main_offsets))} of {expected} grid shards have a main replica")
    return errors


def validate_sharding_integrity(sharded_leaves: list[ShardedBase], group: Any = None) -> list[list[tuple]]:
    """Raise ``CheckpointingException`` on every rank unless the shards of all ranks tile each key.

    Returns the gathered shard records (one list per rank) for callers that need the global view.
    """
    local = [_shard_record(sh) for sh in sharded_leaves]
    gathered = collectives.all_gather_object(local, group)
    errors = _sharding_errors(gathered) if collectives.get_rank(group) == 0 else []
    _raise_sharding_errors(collectives.broadcast_object(errors, 0, group))
    return gathered


def _sharding_errors(gathered: list[list[tuple]]) -> list[str]:
    """Every tiling problem of the shard records of all ranks (one list of records per rank)."""
    by_key: dict[tuple[str, str], list[tuple]] = defaultdict(list)
    for rank_records in gathered:
        for rec in rank_records:
            by_key[(rec[0], rec[1])].append(rec)
    errors: list[str] = []
    for (kind, key), records in sorted(by_key.items()):
        errors += _check_tensor_key(key, records) if kind == "t" else _check_object_key(key, records)
    return errors


def _raise_sharding_errors(errors: list[str]) -> None:
    if errors:
        shown = "\n  ".join(errors[:20])
        more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
        raise CheckpointingException(f"invalid sharding of the state dict:\n  {shown}{more}")


def validate_common_state_consistency(common_state: Any, group: Any = None) -> None:
    """Log a warning on rank 0 when the common (non-sharded) state differs between ranks."""
    gathered = collectives.all_gather_object(common_state, group)
    if collectives.get_rank(group) != 0:
        return
    for rank, other in enumerate(gathered[1:], start=1):
        only_0, only_r, mismatch = diff(gathered[0], other)
        if only_0 or only_r or mismatch:
            logger.warning(
                "common state differs between rank 0 and rank %d (only on rank 0: %s, only on rank %d: %s, "
                "different: %s); rank 0's copy is saved", rank, only_0[:5], rank, only_r[:5],
                [m[0] for m in mismatch[:5]],
            )


def check_load_requests(sharded_leaves: list[ShardedBase], metadata: Metadata, checkpoint_dir: str) -> list[str]:
    """Check requested keys against the checkpoint; return the missing storage keys.

    Raises on a kind mismatch (tensor vs object) or a global shape mismatch, naming the key and
    both shapes (``allow_shape_mismatch`` tensors may differ in shape).
    """
    missing = []
    md = metadata.state_dict_metadata
    for sh in sharded_leaves:
        storage_key = sh.unique_key if isinstance(sh, ShardedObject) else sh.key
        entry = md.get(storage_key)
        if entry is None:
            if isinstance(sh, ShardedObject):
                saved = sorted(k for k in md if k.startswith(f"{sh.key}/shard_"))
                if saved:
                    raise CheckpointingException(
                        f"{checkpoint_dir}: ShardedObject {sh.key!r} was saved as {saved[:4]} but "
                        f"{storage_key!r} is requested (the object grid differs)"
                    )
            missing.append(storage_key)
            continue
        if isinstance(sh, ShardedTensor):
            if not isinstance(entry, TensorStorageMetadata):
                raise CheckpointingException(f"{checkpoint_dir}: key {sh.key!r} is not a tensor in the checkpoint")
            saved_shape = tuple(entry.size)
            if saved_shape != tuple(sh.global_shape) and not sh.allow_shape_mismatch:
                raise CheckpointingException(
                    f"{checkpoint_dir}: shape mismatch for key {sh.key!r}: checkpoint has global shape "
                    f"{saved_shape}, the model expects {tuple(sh.global_shape)} (local shard {sh.local_shape})"
                )
            if len(saved_shape) != len(sh.global_shape):
                raise CheckpointingException(
                    f"{checkpoint_dir}: key {sh.key!r} has {len(saved_shape)} dims {saved_shape} in the checkpoint, "
                    f"the model expects {len(sh.global_shape)} dims {tuple(sh.global_shape)}"
                )
        elif not isinstance(entry, BytesStorageMetadata):
            raise CheckpointingException(f"{checkpoint_dir}: key {storage_key!r} is a tensor, not an object")
    return missing


def determine_global_metadata(sharded_state_dict: dict[str, Any], process_group: Any = None,
                              ) -> tuple[list[ShardedBase], list[list[ShardedBase]]]:
    """``(this rank's shards without data, every rank's list)``, gathered over ``process_group``.

    Every leaf of ``sharded_state_dict`` must be a sharded object (``ShardedTensor``/``ShardedObject``).
    Without an initialized ``torch.distributed`` and no ``process_group``, the global list is this rank's.
    """
    local_metadata = [sh.without_data() for sh in nested_values(sharded_state_dict)]
    if process_group is None and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local_metadata, [local_metadata]
    global_metadata: list[Any] = [None] * torch.distributed.get_world_size(group=process_group)
    torch.distributed.all_gather_object(global_metadata, local_metadata, group=process_group)
    return local_metadata, global_metadata


def verify_checkpoint(checkpoint_dir: str | os.PathLike) -> None:
    """``CheckpointingException`` unless ``checkpoint_dir`` is a directory holding a distributed checkpoint.

    (``manifest.verify_checkpoint``, this library's checksum verification, is another function.)
    """
    if not Path(checkpoint_dir).is_dir():
        raise CheckpointingException(f"Checkpoint directory {checkpoint_dir} does not exist")
    if not check_is_distributed_checkpoint(checkpoint_dir):
        raise CheckpointingException(f"{checkpoint_dir} is not a distributed checkpoint (no valid metadata.json)")


def adjust_non_strict_load(sharded_state_dict: dict[str, Any], sharded_keys_to_remove: set[str]) -> dict[str, Any]:
    """``sharded_state_dict`` without the sharded leaves whose key is in ``sharded_keys_to_remove``."""

    def unexpected(leaf: Any) -> bool:
        if not isinstance(leaf, ShardedBase):
            raise CheckpointingException(f"adjust_non_strict_load: leaf of type {type(leaf).__name__} is not sharded")
        return leaf.key in sharded_keys_to_remove

    _, kept = extract_matching_values(sharded_state_dict, unexpected)
    return kept


def _determine_missing_and_unexpected_keys(
    ckpt_sharded_metadata: dict[str, ShardedBase], local_metadata: list[ShardedBase],
    global_metadata: list[list[ShardedBase]] | None = None,
) -> tuple[set[str], set[str]]:
    """``(missing, unexpected)``: checkpoint keys no rank requests (empty without ``global_metadata``) and keys
    this rank requests that the checkpoint lacks."""
    ckpt_keys = {sh.key for sh in ckpt_sharded_metadata.values()}
    unexpected = {sh.key for sh in local_metadata} - ckpt_keys
    missing: set[str] = set()
    if global_metadata is not None:
        missing = ckpt_keys - {sh.key for rank_metadata in global_metadata for sh in rank_metadata}
    return missing, unexpected


def maybe_report_missing_and_unexpected_keys(missing_keys: set[str], unexpected_keys: set[str],
                                             raise_error: bool = True) -> None:
    """Raise ``CheckpointingException`` (or log a warning when ``raise_error`` is False) naming the missing keys
    (in the checkpoint, requested by no rank) and the unexpected keys (requested here, not in the checkpoint);
    nothing when both sets are empty."""
    if not missing_keys and not unexpected_keys:
        return
    parts = []
    if missing_keys:
        parts.append(f"keys in the checkpoint requested by no rank (missing, all ranks): {sorted(missing_keys)}")
    if unexpected_keys:
        parts.append(f"keys requested by this rank that the checkpoint lacks (unexpected): {sorted(unexpected_keys)}")
    message = "; ".join(parts)
    if raise_error:
        raise CheckpointingException(message)
    logger.warning(message)


def validate_integrity_and_strict_load(
    sharded_state_dict: dict[str, Any],
    strict: StrictHandling,
    validate_access_integrity: bool,
    local_metadata: list[ShardedBase] | None = None,
    global_metadata: list[list[ShardedBase]] | None = None,
    ckpt_sharded_metadata: dict[str, ShardedBase] | None = None,
) -> tuple[dict[str, Any], set[str], set[str]]:
    """``(sharded_state_dict without unexpected keys, missing_keys, unexpected_keys)`` for a load under ``strict``.

    Megatron-Core's naming (the reverse of :func:`~megatron_core.dist_checkpointing.serialization.load`'s
    messages): *unexpected* keys are requested by this rank but absent from the checkpoint
    (``ckpt_sharded_metadata``, e.g. from ``load_sharded_metadata``); *missing* keys are in the checkpoint but
    requested by no rank (needs ``global_metadata``, every rank's list of requested shards; the ``*_unexpected``
    modes skip them). ``raise_*`` modes raise, ``log_*`` modes warn, ``ignore_all`` returns empty sets.
    ``validate_access_integrity`` checks that ``global_metadata`` tiles every tensor exactly once. Runs no
    collectives: gather ``global_metadata`` first (``determine_global_metadata``).
    """
    missing: set[str] = set()
    unexpected: set[str] = set()
    if strict != StrictHandling.ASSUME_OK_UNEXPECTED:  # ignore_all too: it drops the unexpected keys silently
        if ckpt_sharded_metadata is None:
            raise CheckpointingException(f"strict={strict.value} needs ckpt_sharded_metadata (got None)")
        if local_metadata is None:
            local_metadata = [sh.without_data() for sh in nested_values(sharded_state_dict)]
        only_unexpected = strict in (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.LOG_UNEXPECTED,
                                     StrictHandling.RAISE_UNEXPECTED, StrictHandling.RETURN_UNEXPECTED)
        missing, unexpected = _determine_missing_and_unexpected_keys(
            ckpt_sharded_metadata, local_metadata, None if only_unexpected else global_metadata)
        sharded_state_dict = adjust_non_strict_load(sharded_state_dict, unexpected)
        if strict == StrictHandling.IGNORE_ALL:
            missing, unexpected = set(), set()
        elif strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            maybe_report_missing_and_unexpected_keys(missing, unexpected, True)
        elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
            maybe_report_missing_and_unexpected_keys(missing, unexpected, False)
    if validate_access_integrity:
        if global_metadata is None:
            raise CheckpointingException("validate_access_integrity=True needs global_metadata (got None)")
        _raise_sharding_errors(_sharding_errors([[_shard_record(sh) for sh in rank_metadata]
                                                 for rank_metadata in global_metadata]))
    return sharded_state_dict, missing, unexpected


def _file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_READ_CHUNK), b""):
            sha.update(chunk)
    return sha.hexdigest()


def write_integrity_manifest(checkpoint_dir: str | os.PathLike, known: dict[str, str] | None = None) -> None:
    """Write ``integrity.json`` for every file of ``checkpoint_dir``; digests in ``known`` are not recomputed.

    The save-in-progress marker (removed when the checkpoint is published) and the manifest itself are
    not listed. The file is written atomically.
    """
    root = Path(checkpoint_dir)
    known = known or {}
    files = {
        entry.name: known.get(entry.name) or _file_sha256(entry)
        for entry in sorted(root.iterdir(), key=lambda p: p.name)
        if entry.is_file() and entry.name not in (INTEGRITY_FNAME, IN_PROGRESS_MARKER)
    }
    atomic_write_text(root / INTEGRITY_FNAME, json.dumps({"algorithm": HASH_ALGORITHM, "files": files}, indent=2))


def save_integrity_manifest(checkpoint_dir: str | os.PathLike) -> None:
    """Hash every file of ``checkpoint_dir`` (SHA-256) into ``integrity.json`` (Megatron-Core's integrity manifest).

    ``{"algorithm": "sha256", "files": {name: hex digest}}``; ``save(..., verify_integrity=True)`` writes
    it as part of the checkpoint and ``load(..., verify_integrity=True)`` checks it.
    """
    write_integrity_manifest(checkpoint_dir)


def _integrity_errors(checkpoint_dir: Path) -> str | None:
    path = checkpoint_dir / INTEGRITY_FNAME
    if not path.is_file():
        return (f"Integrity manifest not found at {path}. The checkpoint must be saved with integrity verification "
                "enabled (verify_integrity=True) before it can be verified on load.")
    try:
        data = json.loads(path.read_text())
        algorithm, files = data.get("algorithm", HASH_ALGORITHM), data["files"]
    except (OSError, ValueError, KeyError, AttributeError) as e:
        return f"cannot read the integrity manifest {path}: {type(e).__name__}: {e}"
    if algorithm != HASH_ALGORITHM:
        return f"Unsupported hash algorithm in integrity manifest: {algorithm!r}. Expected: {HASH_ALGORITHM!r}."
    problems = []
    for name, expected in files.items():
        if not isinstance(name, str) or name != os.path.basename(name) or name in ("", ".", ".."):
            problems.append(f"  {name!r}: not a plain file name inside the checkpoint")
            continue
        try:
            actual = _file_sha256(checkpoint_dir / name)
        except OSError as e:
            problems.append(f"  {name}: file missing or unreadable ({e})")
            continue
        if actual != expected:
            problems.append(f"  {name}: hash mismatch (expected {str(expected)[:16]}..., got {actual[:16]}...)")
    if problems:
        return (f"Checkpoint integrity verification failed for {len(problems)} file(s) in {checkpoint_dir}:\n"
                + "\n".join(problems))
    return None


def verify_integrity_manifest(checkpoint_dir: str | os.PathLike) -> None:
    """Re-hash the files listed in ``integrity.json``; ``CheckpointingException`` on a missing manifest or file
    or a mismatch. Rank 0 checks and every rank raises the same error."""
    errors = None
    if collectives.get_rank() == 0:
        errors = _integrity_errors(Path(checkpoint_dir))
    errors = collectives.broadcast_object(errors, 0)
    if errors is not None:
        raise CheckpointingException(errors)
