"""Entry points: ``save`` and ``load`` of sharded state dicts (Megatron-Core ``serialization``).

A checkpoint directory holds DCP's ``.metadata`` and ``__<rank>_<n>.distcp`` files and ``metadata.json``
(backend and version; written last). As in megatron-core 0.19 the common (non-sharded) state is one more
DCP byte entry, the ShardedObject ``common_state`` (unique key ``common_state/shard_0_1``, written by rank
0 as ``torch.save([state])``). Checkpoints of megatron-core <= 0.18 keep it in a separate ``common.pt`` instead; both
are read (``common.pt`` first, as 0.19 does), always with ``torch.load(weights_only=True)``, and ``save(...,
common_strategy="torch")`` writes that older layout (:mod:`.common_state`). The sharded strategy follows the
arguments as in Megatron-Core (:mod:`.strategy_resolution`).

Crash safety: everything is written into ``<dir>.tmp-<id>`` and renamed to ``<dir>`` only when
every rank has finished, so ``<dir>`` is either absent, the previous checkpoint, or complete; a
write that fails because the disk is full says so, with the bytes needed and free (:mod:`.disk_space`).
Saving never removes what it did not write (:mod:`.save_target`): a complete checkpoint or a
directory holding other files is refused unless ``overwrite=True``, a regular file at the path is
an error. Every file is hashed while written and ``sha256_manifest.json`` records the digests
(:mod:`.manifest`); ``load(..., verify_checksums=True)`` checks them. Loading validates the
metadata and every requested key and shape before reading, reads into fresh buffers, and fails
on every rank if it fails on any, so a model is never loaded partially.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import pickle
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.common_state import COMMON_STATE_FNAME as COMMON_STATE_FNAME
from megatron_core.dist_checkpointing.common_state import COMMON_STATE_KEY as COMMON_STATE_KEY
from megatron_core.dist_checkpointing.common_state import COMMON_STATE_UNIQUE_KEY as COMMON_STATE_UNIQUE_KEY
from megatron_core.dist_checkpointing.common_state import CONTENT_METADATA_KEY as CONTENT_METADATA_KEY
from megatron_core.dist_checkpointing.common_state import check_common_strategy, common_state_object
from megatron_core.dist_checkpointing.common_state import read_common_state as _read_common_state
from megatron_core.dist_checkpointing.common_state import serialize_common as _serialize_common
from megatron_core.dist_checkpointing.core import (
    CheckpointingConfig,
    CheckpointingException,
    atomic_write_bytes,
    check_is_distributed_checkpoint,
    fsync_dir,
    save_config,
)
from megatron_core.dist_checkpointing.dict_utils import (
    extract_matching_values,
    lists_like,
    merge,
    nested_values,
)
from megatron_core.dist_checkpointing.disk_space import explain_write_failure, explaining_space, state_nbytes
from megatron_core.dist_checkpointing.manifest import sha256_bytes, verify_checkpoint, write_manifest
from megatron_core.dist_checkpointing.mapping import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factory_merges,
)
from megatron_core.dist_checkpointing.safe_load import DCP_METADATA_FNAME
from megatron_core.dist_checkpointing.save_target import (
    IN_PROGRESS_MARKER,
    check_save_target,
    remove_stale_tmp_dirs,
    replace_target,
)
from megatron_core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron_core.dist_checkpointing.strategies import (
    AsyncRequest,
    LoadShardedStrategy,
    SaveShardedStrategy,
    TorchDistLoadShardedStrategy,
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron_core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy
from megatron_core.dist_checkpointing.strategy_resolution import (
    check_async_strategy,
    checkpoint_strategy,
    resolve_save_strategy,
)
from megatron_core.dist_checkpointing.validation import (
    StrictHandling,
    check_load_requests,
    parse_strict_flag,
    verify_integrity_manifest,
    write_integrity_manifest,
)

CkptShardedMetadata = dict[str, ShardedTensor | ShardedObject]
"""Type of :func:`load_sharded_metadata`'s result: each key's sharded tensor or object."""
logger = logging.getLogger(__name__)


def _publish(tmp_dir: Path, final_dir: Path, overwrite: bool) -> None:
    """Move a finished checkpoint from ``tmp_dir`` to ``final_dir`` (rank 0 only).

    What ``final_dir`` may hold is decided by :func:`.save_target.check_save_target`; only a
    directory that was checked there is moved aside and removed once the new one is in place.
    """
    old = replace_target(tmp_dir, final_dir, overwrite)
    (tmp_dir / IN_PROGRESS_MARKER).unlink(missing_ok=True)
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str | os.PathLike,
    sharded_strategy: SaveShardedStrategy | tuple[str, int] | None = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Callable[[StateDict], StateDict] | None = None,
    content_metadata: dict | None = None,
    *,
    async_strategy: str | None = None,
    verify_integrity: bool = False,
    overwrite: bool = False,
    process_group: Any = None,
) -> AsyncRequest | None:
    """Save ``sharded_state_dict`` into ``checkpoint_dir``; a collective call on ``process_group``.

    Factories are applied in place, ``LocalNonpersistentObject``s are dropped, sharded leaves are
    written by the strategy and the rest (the common state) by rank 0. With
    ``async_sharded_save`` the returned :class:`AsyncRequest` must be scheduled on an
    ``AsyncCallsQueue`` (or run with ``execute_sync``); the checkpoint appears under
    ``checkpoint_dir`` only when it is finalized. ``overwrite`` (not in Megatron-Core) allows
    replacing a complete checkpoint. ``common_strategy`` (megatron-core <= 0.18's argument, gone in
    0.19): ``None`` writes 0.19's layout (common state inside the DCP files), ``"torch"`` writes the
    older ``common.pt`` layout that megatron-core <= 0.18 needs. ``verify_integrity`` also writes
    ``integrity.json`` (the SHA-256 of every file, see :func:`.validation.save_integrity_manifest`).
    ``async_strategy``: ``None`` (default) or ``"mcore"`` use this library's writer; ``"nvrx"`` needs
    nvidia-resiliency-ext (``ModuleNotFoundError`` without it) and writes the same files.
    """
    check_async_strategy(async_strategy)
    final_dir = Path(checkpoint_dir)
    group = process_group
    rank = collectives.get_rank(group)
    check_common_strategy(common_strategy)
    strategy = resolve_save_strategy(sharded_strategy)
    refusal = None
    if rank == 0:
        try:
            check_save_target(final_dir, overwrite)
        except CheckpointingException as e:
            refusal = str(e)
    refusal = collectives.broadcast_object(refusal, 0, group)
    if refusal is not None:
        raise CheckpointingException(refusal)

    legacy_common = common_strategy is not None
    if content_metadata is not None:
        sharded_state_dict[CONTENT_METADATA_KEY] = content_metadata
    reserved = [sh.key for sh in nested_values(sharded_state_dict)
                if isinstance(sh, (ShardedBase, ShardedTensorFactory)) and sh.key == COMMON_STATE_KEY]
    if reserved:
        raise CheckpointingException(
            f"the key {COMMON_STATE_KEY!r} is reserved for the common state; rename the sharded entry using it"
        )
    sharded_part, common_state = save_preprocess(sharded_state_dict, validate_access_integrity,
                                                 preprocess_common_before_consistancy_check, process_group=group)

    tmp_name = f"{final_dir.name}.tmp-{uuid.uuid4().hex[:12]}" if rank == 0 else None
    tmp_dir = final_dir.with_name(collectives.broadcast_object(tmp_name, 0, group))
    error = None
    common_bytes = b""
    if rank == 0:
        try:
            kept = remove_stale_tmp_dirs(final_dir)
            if kept:
                logger.warning("left in place (not written by an interrupted save of this library): %s",
                               [str(k) for k in kept])
            tmp_dir.mkdir(parents=True)
            (tmp_dir / IN_PROGRESS_MARKER).touch()
            common_bytes = _serialize_common(common_state)
            if legacy_common:
                atomic_write_bytes(tmp_dir / COMMON_STATE_FNAME, common_bytes)
        except Exception as e:  # noqa: BLE001 - sent to every rank below
            error = explain_write_failure(e, tmp_dir, len(common_bytes))
    if collectives.broadcast_object(error is not None, 0, group):
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise CheckpointingException(f"saving {final_dir} failed on rank 0: {error}") from error

    if not legacy_common:
        sharded_part = {**sharded_part, COMMON_STATE_KEY: common_state_object(common_state, rank)}
    if isinstance(strategy, AsyncSaveShardedStrategy):
        request = strategy.save_request(sharded_part, tmp_dir, stage=async_sharded_save)
    elif async_sharded_save:
        raise CheckpointingException(f"{type(strategy).__name__} cannot save asynchronously")
    else:
        request = AsyncRequest(strategy.save, (sharded_part, tmp_dir), [])
    if request.async_fn is not None:  # a full disk is reported as such (path, bytes needed and free)
        # (replace() shares finalize_fns and file_digests with the strategy's request, which fills them)
        request = dataclasses.replace(request, async_fn=explaining_space(
            request.async_fn, tmp_dir, state_nbytes(nested_values(sharded_part))))

    def finalize() -> None:
        failure = None
        if rank == 0:
            try:
                if not (tmp_dir / DCP_METADATA_FNAME).is_file():
                    raise CheckpointingException(f"{tmp_dir / DCP_METADATA_FNAME} was not written")
                digests = dict(request.file_digests)
                config = CheckpointingConfig(strategy.backend, strategy.version)
                if legacy_common:
                    digests[COMMON_STATE_FNAME] = sha256_bytes(common_bytes)
                    config.common_backend, config.common_backend_version = "torch", 1
                write_manifest(tmp_dir, digests)
                save_config(config, tmp_dir)
                if verify_integrity:
                    write_integrity_manifest(tmp_dir, {name: digest for name, (digest, _) in digests.items()})
                _publish(tmp_dir, final_dir, overwrite)
            except Exception as e:  # noqa: BLE001 - sent to every rank below
                e = explain_write_failure(e, tmp_dir)
                failure = f"{type(e).__name__}: {e}"
                shutil.rmtree(tmp_dir, ignore_errors=True)  # ours alone (a full disk stays full otherwise)
        failure = collectives.broadcast_object(failure, 0, group)
        if failure is not None:
            raise CheckpointingException(f"finalizing checkpoint {final_dir} failed: {failure}")

    request.add_finalize_fn(finalize)
    if async_sharded_save:
        return request
    _run_now(request, tmp_dir, rank, group)
    return None


def _run_now(request: AsyncRequest, tmp_dir: Path, rank: int, group: Any) -> None:
    """Write, agree across ranks that every write succeeded, then finalize (a synchronous save)."""
    error = None
    try:
        if request.async_fn is not None:
            request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
    except Exception as e:  # noqa: BLE001 - reported on every rank
        error = e
    if collectives.any_rank_true(error is not None, group):
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        reason = f"{type(error).__name__}: {error}" if error else "a write failed on another rank"
        raise CheckpointingException(f"saving {tmp_dir} failed: {reason}") from error
    for fn in request.finalize_fns:
        fn()


def _storage_key(sh: ShardedBase) -> str:
    return sh.unique_key if isinstance(sh, ShardedObject) else sh.key


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str | os.PathLike,
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    process_group: Any = None,
    verify_checksums: bool = False,
    verify_integrity: bool = False,
    common_state_dict: StateDict | None = None,
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """Load the shards described by ``sharded_state_dict`` (any parallel layout) plus the common state.

    Returns a state dict shaped like ``sharded_state_dict`` with loaded tensors and objects
    (factories merged back, ``LocalNonpersistentObject``s unwrapped), merged into the saved common
    state; feed it to ``module.load_state_dict``. ``strict`` decides what missing and unexpected
    keys do (see :class:`StrictHandling`); ``return_*`` modes also return the two key sets.
    Collective: if any rank fails, every rank raises ``CheckpointingException``.
    ``verify_checksums`` (not in Megatron-Core) first checks every file against the checkpoint's
    SHA-256 manifest (see :mod:`.manifest`), the work split across the ranks. ``verify_integrity``
    first checks the files against ``integrity.json`` (written by ``save(..., verify_integrity=True)``).
    ``common_state_dict`` (not in Megatron-Core): the checkpoint's common state, already read by
    :func:`load_common_state_dict` (it is copied, not read again). Pass the strategy used to read
    anything else of the checkpoint as ``sharded_strategy``: it keeps ``metadata.json`` and ``.metadata``.
    """
    strict = parse_strict_flag(strict)
    check_common_strategy(common_strategy)
    group = process_group
    if verify_integrity:
        verify_integrity_manifest(checkpoint_dir)
    if verify_checksums:
        verify_checkpoint(checkpoint_dir, group)
    error: BaseException | None = None
    result: StateDict = {}
    missing: set[str] = set()
    requested: set[str] = set()
    strategy: TorchDistLoadShardedStrategy | None = None
    try:
        strategy = checkpoint_strategy(checkpoint_dir, sharded_strategy)
        common_state = (copy.deepcopy(common_state_dict) if common_state_dict is not None
                        else load_common_state_dict(checkpoint_dir, sharded_strategy=strategy))
        preprocessed, nonpersistent, factories = load_preprocess(sharded_state_dict)
        sharded_part, _ = extract_matching_values(
            preprocessed, lambda x: isinstance(x, ShardedBase), return_lists_as_dicts=True
        )
        leaves = [v for v in nested_values(sharded_part) if isinstance(v, ShardedBase)]
        requested = {_storage_key(sh) for sh in leaves}
        missing = set(check_load_requests(leaves, strategy.metadata(checkpoint_dir), str(checkpoint_dir)))
        if missing and not StrictHandling.tolerates_missing_keys(strict):
            raise CheckpointingException(
                f"{checkpoint_dir}: {len(missing)} requested keys are missing from the checkpoint: {sorted(missing)[:10]}"
            )
        if missing:
            sharded_part, _ = extract_matching_values(
                sharded_part, lambda x: isinstance(x, ShardedBase) and _storage_key(x) not in missing,
                return_lists_as_dicts=True,
            )
        loaded = lists_like(strategy.load(sharded_part, checkpoint_dir), sharded_state_dict)
        nonpersistent = lists_like(nonpersistent, sharded_state_dict)
        result = merge(merge(common_state, loaded), nonpersistent)
        if factories:
            result = apply_factory_merges(result, factories)
    except Exception as e:  # noqa: BLE001 - every rank must learn about a failure on any rank
        error = e
    if collectives.any_rank_true(error is not None, group):
        if error is not None:
            if isinstance(error, CheckpointingException):
                raise error
            raise CheckpointingException(f"loading {checkpoint_dir} failed: {type(error).__name__}: {error}") from error
        raise CheckpointingException(f"loading {checkpoint_dir} failed on another rank")

    unexpected: set[str] = set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        assert strategy is not None
        all_requested = set().union(*collectives.all_gather_object(requested, group))
        saved = set(strategy.metadata(checkpoint_dir).state_dict_metadata) - {COMMON_STATE_UNIQUE_KEY}
        unexpected = saved - all_requested
        _report_mismatch(strict, missing, unexpected, checkpoint_dir)
    elif missing and strict == StrictHandling.LOG_ALL:
        _report_mismatch(strict, missing, unexpected, checkpoint_dir)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return result, missing, unexpected
    return result


def _report_mismatch(strict: StrictHandling, missing: set[str], unexpected: set[str],
                     checkpoint_dir: str | os.PathLike) -> None:
    if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL) and unexpected:
        raise CheckpointingException(
            f"{checkpoint_dir}: {len(unexpected)} keys in the checkpoint were not requested: {sorted(unexpected)[:10]}"
        )
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and unexpected:
        logger.warning("%s: keys in the checkpoint not requested: %s", checkpoint_dir, sorted(unexpected)[:20])
    if strict == StrictHandling.LOG_ALL and missing:
        logger.warning("%s: requested keys missing from the checkpoint: %s", checkpoint_dir, sorted(missing)[:20])


def load_common_state_dict(checkpoint_dir: str | os.PathLike, *,
                           sharded_strategy: TorchDistLoadShardedStrategy | None = None) -> StateDict:
    """The common (non-sharded) state saved by rank 0, read with ``weights_only=True``; it includes the
    ``content_metadata`` given to ``save`` (as Megatron-Core's, so ``load`` returns it too).

    Read from ``common.pt`` when the checkpoint has one (megatron-core <= 0.18), else from the
    ``common_state`` entry of the DCP files (megatron-core 0.19); no collectives. ``sharded_strategy``
    (not in Megatron-Core): a load strategy that may already hold the checkpoint's ``.metadata``.
    """
    return _read_common_state(checkpoint_dir, sharded_strategy)


def load_content_metadata(checkpoint_dir: str | os.PathLike | None = None, *,
                          preloaded_state_dict: StateDict | None = None) -> dict | None:
    """The ``content_metadata`` given to ``save`` (``None`` if none was given)."""
    if preloaded_state_dict is not None:
        return preloaded_state_dict.get(CONTENT_METADATA_KEY)
    if checkpoint_dir is None:
        raise ValueError("load_content_metadata needs checkpoint_dir or preloaded_state_dict")
    return _read_common_state(checkpoint_dir).get(CONTENT_METADATA_KEY)


def load_tensors_metadata(checkpoint_dir: str | os.PathLike,
                          sharded_strategy: LoadShardedStrategy | None = None) -> ShardedStateDict:
    """Data-less ShardedTensors (global shape, dtype) for every tensor in the checkpoint."""
    return checkpoint_strategy(checkpoint_dir, sharded_strategy).load_tensors_metadata(checkpoint_dir)


def load_sharded_metadata(checkpoint_dir: str | os.PathLike, sharded_strategy: LoadShardedStrategy | None = None,
                          common_strategy: Any = None) -> ShardedStateDict:
    """Data-less ShardedTensors and ShardedObjects for everything in the checkpoint."""
    check_common_strategy(common_strategy)
    return checkpoint_strategy(checkpoint_dir, sharded_strategy).load_sharded_metadata(checkpoint_dir)


def load_plain_tensors(checkpoint_dir: str | os.PathLike) -> StateDict:
    """Every tensor of the checkpoint as one full (unsharded) CPU tensor on this rank; no collectives."""
    strategy = checkpoint_strategy(checkpoint_dir)
    sharded = strategy.load_tensors_metadata(checkpoint_dir)
    for sh in sharded.values():
        sh.init_data("cpu")
    return strategy.load(sharded, checkpoint_dir)


def remove_sharded_tensors(checkpoint_dir: str | os.PathLike, key_prefix: str) -> None:
    """Drop every tensor whose key starts with ``key_prefix`` from the checkpoint's metadata (rank 0 only).

    The bytes stay in the data files but are no longer reachable; ``.metadata`` is replaced atomically.
    """
    metadata = checkpoint_strategy(checkpoint_dir, TorchDistLoadShardedStrategy()).metadata(checkpoint_dir)
    metadata.state_dict_metadata = {
        k: v for k, v in metadata.state_dict_metadata.items() if not k.startswith(key_prefix)
    }
    metadata.storage_data = {
        k: v for k, v in metadata.storage_data.items() if not k.fqn.startswith(key_prefix)
    }
    atomic_write_bytes(Path(checkpoint_dir) / DCP_METADATA_FNAME, pickle.dumps(metadata))


__all__ = [
    "CheckpointingException",
    "CkptShardedMetadata",
    "StrictHandling",
    "check_is_distributed_checkpoint",
    "get_default_load_sharded_strategy",
    "get_default_save_sharded_strategy",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "remove_sharded_tensors",
    "save",
]
