"""The ``fsdp_dtensor`` checkpoint format (Megatron-LM's ``--ckpt-format fsdp_dtensor``): DCP over state dicts.

``<save_dir>/iter_0000010/`` holds one ``torch.distributed.checkpoint`` save of a flat dict of tensors:
``model.<state-dict key>`` (FSDP2 ``DTensor`` shards, or plain tensors written once) and
``optimizer.state.<state-dict key>.<state name>`` (``exp_avg``, ``exp_avg_sq``, ``step``, ... sharded like
the parameter), after the helpers of :mod:`megatron_core.transformer.fsdp_dtensor_checkpoint` renamed
experts to global indices and cut fused SwiGLU / gated-delta-net tensors into sections. DCP reshards
the DTensors, so a checkpoint saved at DP=2 loads at DP=1 or DP=4 (and an EP=2 one at EP=1). Beside
it, ``common.pt`` (rank 0; read with ``weights_only=True``) keeps the iteration, consumed samples,
scheduler state, extra state, architecture record and every rank's RNG states.

Saving is atomic as ``dist_checkpointing``'s: files go to ``<dir>.tmp-<id>``, which is renamed into
place once complete; the tracker moves last. Loading never unpickles: DCP's ``.metadata`` is read
with the restricted unpickler and only tensor entries are requested.

Served layouts: one model chunk, TP = PP = CP = 1, wrapped in ``TorchFullyShardedDataParallel`` (or
Megatron-FSDP's ``optim_grads_params``), or in ``DistributedDataParallel`` (any EP) with an optimizer that
updates the model parameters in place (fp32, ``use_distributed_optimizer=False``). Others raise ``ValueError``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.common_state import COMMON_STATE_FNAME, serialize_common
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.safe_load import DCP_METADATA_FNAME, torch_load_safe
from megatron_core.dist_checkpointing.save_target import (
    IN_PROGRESS_MARKER,
    remove_stale_tmp_dirs,
    replace_target,
)
from megatron_core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from megatron_core.dist_checkpointing.tracker import get_checkpoint_name, write_tracker
from megatron_core.training.fsdp_dtensor_state import (
    check_fsdp_dtensor_layout,
    fsdp_dtensor_state_dict,
    init_optimizer_states,
)
from megatron_core.training.rng import get_rng_state, set_rng_state

FORMAT = "fsdp_dtensor"
FORMAT_KEY = "ckpt_format"

__all__ = ["FORMAT", "is_fsdp_dtensor_checkpoint", "load_fsdp_dtensor_checkpoint", "save_fsdp_dtensor_checkpoint"]


def _rank0(fn: Any, what: str) -> Any:
    """``fn()`` on rank 0, its result broadcast; every rank raises if it failed."""
    result, failure = None, None
    if collectives.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - sent to every rank below
            failure = f"{type(e).__name__}: {e}"
    result, failure = collectives.broadcast_object((result, failure), 0)
    if failure is not None:
        raise CheckpointingException(f"{what} failed on rank 0: {failure}")
    return result


def is_fsdp_dtensor_checkpoint(checkpoint_dir: str | os.PathLike) -> bool:
    """Whether ``checkpoint_dir`` looks like a complete ``fsdp_dtensor`` checkpoint (DCP metadata and common state)."""
    path = Path(checkpoint_dir)
    return (path / DCP_METADATA_FNAME).is_file() and (path / COMMON_STATE_FNAME).is_file() \
        and not (path / "metadata.json").exists()


def _prepare_tmp_dir(final_dir: Path, overwrite: bool) -> str:
    if is_fsdp_dtensor_checkpoint(final_dir) and not overwrite:
        raise CheckpointingException(f"{final_dir} already holds a complete checkpoint; pass overwrite=True to "
                                     "replace it")
    remove_stale_tmp_dirs(final_dir)
    tmp = final_dir.with_name(f"{final_dir.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    (tmp / IN_PROGRESS_MARKER).touch()
    return str(tmp)


def _publish(tmp: Path, final_dir: Path, common: bytes, overwrite: bool) -> None:
    with open(tmp / COMMON_STATE_FNAME, "wb") as f:
        f.write(common)
        f.flush()
        os.fsync(f.fileno())
    (tmp / IN_PROGRESS_MARKER).unlink()
    old = replace_target(tmp, final_dir, overwrite)
    os.rename(tmp, final_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_fsdp_dtensor_checkpoint(save_dir: str | os.PathLike, iteration: int, model: Any, optimizer: Any,
                                 opt_param_scheduler: Any, *, consumed_train_samples: int = 0,
                                 extra_state: Any = None, overwrite: bool = False,
                                 architecture: dict[str, Any] | None = None) -> None:
    """Save the training state in the ``fsdp_dtensor`` format and move the tracker; collective."""
    chunks = check_fsdp_dtensor_layout(model, optimizer)
    flat = fsdp_dtensor_state_dict(chunks[0], optimizer)
    rng = collectives.all_gather_object(get_rng_state())
    common = {FORMAT_KEY: FORMAT, "iteration": int(iteration), "consumed_train_samples": int(consumed_train_samples),
              "extra_state": extra_state, "checkpoint_version": 3.0, "architecture": architecture,
              "opt_param_scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler is not None else None,
              "rng_state": rng, "world_size": collectives.get_world_size(),
              "has_optimizer": optimizer is not None}
    data = _rank0(lambda: serialize_common(common), "serializing the common state")
    final_dir = Path(get_checkpoint_name(save_dir, iteration))
    tmp = Path(_rank0(lambda: _prepare_tmp_dir(final_dir, overwrite), f"preparing {final_dir}"))
    dcp.save(flat, storage_writer=FileSystemWriter(tmp, sync_files=True, thread_count=1),
             planner=DefaultSavePlanner())
    collectives.barrier()
    _rank0(lambda: _publish(tmp, final_dir, data, overwrite), f"publishing {final_dir}")
    _rank0(lambda: write_tracker(save_dir, iteration), f"writing the tracker of {save_dir}")


def _check_against_metadata(checkpoint_dir: Path, flat: dict[str, Any], saved: dict[str, Any], strict: bool) -> None:
    """Raise naming the keys the checkpoint lacks, holds as non-tensors or with another shape (and, when
    ``strict``, model keys of the checkpoint this model does not have); collective."""
    problems = []
    missing = sorted(k for k in flat if k not in saved)
    if missing:
        problems.append(f"{len(missing)} keys are missing from the checkpoint: {missing[:10]}")
    not_tensor = sorted(k for k in flat if k in saved and not hasattr(saved[k], "size"))
    if not_tensor:
        problems.append(f"entries are not tensors: {not_tensor[:10]}")
    shapes = [f"{k}: saved {tuple(saved[k].size)}, model {tuple(v.shape)}" for k, v in flat.items()
              if k in saved and hasattr(saved[k], "size") and tuple(saved[k].size) != tuple(v.shape)]
    if shapes:
        problems.append(f"shapes differ: {shapes[:10]}")
    if strict:
        wanted = {k for rank_keys in collectives.all_gather_object(sorted(flat)) for k in rank_keys}
        extra = sorted(k for k in saved if k.startswith("model.") and k not in wanted)
        if extra:
            problems.append(f"{len(extra)} model keys in the checkpoint are not in the model: {extra[:10]}")
    failures = collectives.all_gather_object("; ".join(problems))
    failed = [(rank, text) for rank, text in enumerate(failures) if text]
    if failed:
        rank, text = failed[0]
        raise CheckpointingException(f"{checkpoint_dir} does not match the model (rank {rank}): {text}")


def load_fsdp_dtensor_checkpoint(checkpoint_dir: str | os.PathLike, model: Any, optimizer: Any,
                                 opt_param_scheduler: Any, *, iteration: int, strict: bool = True,
                                 load_optimizer: bool = True, load_rng: bool = True,
                                 check_common: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Load an ``fsdp_dtensor`` checkpoint into ``model`` (and ``optimizer`` / scheduler); collective.

    ``check_common`` sees the common state (e.g. to compare the recorded architecture) before anything is
    loaded. Returns ``{"iteration", "consumed_train_samples", "extra_state"}``. RNG states are restored when
    the world size is the one saved.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not is_fsdp_dtensor_checkpoint(checkpoint_dir):
        raise CheckpointingException(f"{checkpoint_dir} is not a complete fsdp_dtensor checkpoint (it needs "
                                     f"{DCP_METADATA_FNAME} and {COMMON_STATE_FNAME}, and no metadata.json)")
    common = torch_load_safe(checkpoint_dir / COMMON_STATE_FNAME, str(checkpoint_dir / COMMON_STATE_FNAME))
    if not isinstance(common, dict) or common.get(FORMAT_KEY) != FORMAT:
        raise CheckpointingException(f"{checkpoint_dir / COMMON_STATE_FNAME} does not record ckpt_format "
                                     f"{FORMAT!r}")
    if int(common["iteration"]) != int(iteration):
        raise CheckpointingException(f"{checkpoint_dir} records iteration {common['iteration']} but is named for "
                                     f"iteration {iteration}: the checkpoint was moved or tampered with")
    if check_common is not None:
        check_common(common)
    with_optimizer = load_optimizer and optimizer is not None
    if with_optimizer and not common.get("has_optimizer"):
        raise CheckpointingException(f"{checkpoint_dir} holds no optimizer state; load with load_optimizer=False")
    chunks = check_fsdp_dtensor_layout(model, optimizer if with_optimizer else None)
    reader = CachedMetadataFileSystemReader(checkpoint_dir, cache_metadata=False)
    saved = reader.read_metadata().state_dict_metadata
    if with_optimizer:
        init_optimizer_states(chunks[0], optimizer, saved)
    flat = fsdp_dtensor_state_dict(chunks[0], optimizer if with_optimizer else None)
    _check_against_metadata(checkpoint_dir, flat, saved, strict)
    from megatron_core.transformer.fsdp_dtensor_checkpoint import TensorOnlyLoadPlanner

    dcp.load(flat, storage_reader=reader, planner=TensorOnlyLoadPlanner())
    if with_optimizer and opt_param_scheduler is not None and common.get("opt_param_scheduler") is not None:
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()
    rng = common.get("rng_state")
    if load_rng and isinstance(rng, list) and len(rng) == collectives.get_world_size():
        set_rng_state(rng[collectives.get_rank()])
    return {"iteration": int(common["iteration"]),
            "consumed_train_samples": int(common.get("consumed_train_samples", 0)),
            "extra_state": common.get("extra_state")}
