"""``save_checkpoint`` / ``load_checkpoint``: the whole training state in Megatron-LM's layout.

A checkpoint ``<save_dir>/iter_0000010/`` is one distributed checkpoint (:func:`..save`) whose
state dict has Megatron-LM's top-level keys: ``model`` (or ``model0``, ``model1``, ... for
virtual-pipeline chunks), ``optimizer`` (model-space states, see :mod:`megatron_core.optimizer.checkpoint_state`),
``opt_param_scheduler``, ``rng_state`` (see :mod:`.rng`), ``iteration``,
``consumed_train_samples``, ``extra_state`` and ``checkpoint_version``; and two records of the model,
``model_architecture`` (checked on load, :mod:`.architecture`) and ``model_config`` (the whole config as
JSON, from which inference rebuilds the model, :mod:`.model_config`). The tracker
``latest_checkpointed_iteration.txt`` moves only after the checkpoint directory is complete.

Model and optimizer tensors reshard on load (any TP/PP/DP layout, distributed optimizer on or
off). RNG states are per (pp, tp, dp) rank: under another layout they are not restored and a
warning says so, as in Megatron-LM.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from megatron_core._ground import module_chain, unwrap_model
from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.core import CheckpointingException, check_is_distributed_checkpoint
from megatron_core.dist_checkpointing.disk_space import explain_write_failure
from megatron_core.dist_checkpointing.manifest import verify_checkpoint
from megatron_core.dist_checkpointing.save_target import foreign_entries
from megatron_core.dist_checkpointing.serialization import (
    load,
    load_common_state_dict,
    load_sharded_metadata,
    save,
)
from megatron_core.dist_checkpointing.strategies import TorchDistLoadShardedStrategy
from megatron_core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron_core.dist_checkpointing.tracker import (
    TRACKER_FILENAME,
    get_checkpoint_name,
    read_tracker,
    write_tracker,
)
from megatron_core.dist_checkpointing.validation import StrictHandling
from megatron_core.training.architecture import (
    ARCHITECTURE_KEY,
    check_architecture,
    model_architecture,
)
from megatron_core.training.model_config import MODEL_CONFIG_KEY, model_config_record
from megatron_core.training.rng import (
    RNG_KEY,
    restore_sharded_rng_state,
    sharded_rng_state,
)

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0
CKPT_FORMATS = ("torch_dist", "fsdp_dtensor")
OPTIMIZER_STATE_PREFIX = "optimizer.state."


def unwrap_model_chunks(model: torch.nn.Module | list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Model chunks as a list, each unwrapped (``utils.unwrap_model``) down to one with ``sharded_state_dict``."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    out = []
    for chunk in chunks:
        for inner in module_chain(unwrap_model(chunk)):
            if hasattr(inner, "sharded_state_dict"):
                break
        else:
            raise TypeError(f"{type(chunk).__name__} (unwrapped: {type(inner).__name__}) has no sharded_state_dict")
        out.append(inner)
    return out


def optimizer_sharded_state_dict(optimizer: Any, model_sharded_sd: dict, is_loading: bool = False,
                                 state_names: list[str] | None = None) -> dict:
    """``optimizer.sharded_state_dict(...)``: its state in model space (the optimizer owns the format)."""
    return optimizer.sharded_state_dict(model_sharded_sd, is_loading=is_loading, state_names=state_names)


def load_optimizer_state(optimizer: Any, model_sharded_sd: dict, loaded: dict) -> None:
    """Load a model-space optimizer state (saved by :func:`optimizer_sharded_state_dict`) into ``optimizer``."""
    optimizer.sharded_state_dict(model_sharded_sd, is_loading=True)
    optimizer.load_state_dict(loaded)


def _model_keys(chunks: list[torch.nn.Module]) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    return {key: chunk.sharded_state_dict() for key, chunk in zip(_model_keys(chunks), chunks)}


def _on_rank0(fn: Callable[[], None], what: str, directory: str | os.PathLike = ".") -> None:
    """Run ``fn`` on rank 0; every rank raises if it failed (no rank is left waiting)."""
    failure = None
    if collectives.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - sent to every rank below
            e = explain_write_failure(e, directory)
            failure = f"{type(e).__name__}: {e}"
    failure = collectives.broadcast_object(failure, 0)
    if failure is not None:
        raise CheckpointingException(f"{what} failed on rank 0: {failure}")


def _refuse_foreign_files(checkpoint_dir: os.PathLike) -> None:
    """An ``iter_*`` directory may be replaced only when it holds nothing but files of our own saves."""
    if os.path.isdir(checkpoint_dir):
        foreign = foreign_entries(checkpoint_dir)
        if foreign:
            raise CheckpointingException(
                f"{checkpoint_dir} holds files no checkpoint save wrote: {foreign[:10]}; they would be removed. "
                "Move them away or save into another directory")


def _finish_param_gathers(model: torch.nn.Module | list[torch.nn.Module]) -> None:
    """Bring the parameters up to date before saving them: with ``overlap_param_gather`` the distributed
    optimizer's last update reaches the other data-parallel ranks' parts of each parameter only in the next
    forward (its all-gather is dispatched or waited on there), so until then they hold the weights of before
    the step. Megatron-LM's loop syncs them the same way (``disable_forward_pre_hook``) around a save."""
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        config = getattr(chunk, "ddp_config", None)
        if config is not None and config.use_distributed_optimizer and config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def save_checkpoint(save_dir: str | os.PathLike, iteration: int, model: torch.nn.Module | list[torch.nn.Module],
                    optimizer: Any, opt_param_scheduler: Any, *, consumed_train_samples: int = 0,
                    extra_state: Any = None, async_queue: AsyncCallsQueue | None = None,
                    overwrite: bool = False, ckpt_format: str = "torch_dist") -> None:
    """Save the training state into ``<save_dir>/iter_<iteration:07d>`` and move the tracker; collective.

    ``optimizer`` and ``opt_param_scheduler`` may be ``None``. ``extra_state`` is plain data
    (e.g. the run's arguments). With ``async_queue`` the files are written in the background
    and both the directory and the tracker appear when the queue finalizes the request.
    Saving over a complete checkpoint of the same iteration raises unless ``overwrite``; an
    ``iter_*`` directory holding anything but files of our own (interrupted) saves always raises,
    naming them, and is left as it is.

    ``ckpt_format="fsdp_dtensor"`` writes Megatron-LM's DCP format instead (:mod:`.fsdp_dtensor_format`;
    FSDP2 or DDP models at TP = PP = 1, no ``async_queue``).
    """
    if _check_format(ckpt_format) == "fsdp_dtensor":
        if async_queue is not None:
            raise ValueError("ckpt_format='fsdp_dtensor' saves synchronously; pass async_queue=None")
        from megatron_core.training.fsdp_dtensor_format import save_fsdp_dtensor_checkpoint

        save_fsdp_dtensor_checkpoint(save_dir, iteration, model, optimizer, opt_param_scheduler,
                                     consumed_train_samples=consumed_train_samples, extra_state=extra_state,
                                     overwrite=overwrite, architecture=model_architecture(unwrap_model_chunks(model)))
        return
    _finish_param_gathers(model)
    chunks = unwrap_model_chunks(model)
    state: dict[str, Any] = _model_sharded_state_dict(chunks)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(dict(state))
    state["opt_param_scheduler"] = opt_param_scheduler.state_dict() if opt_param_scheduler is not None else None
    state[RNG_KEY] = sharded_rng_state()
    state.update(iteration=int(iteration), consumed_train_samples=int(consumed_train_samples),
                 extra_state=extra_state, checkpoint_version=CHECKPOINT_VERSION)
    architecture = model_architecture(chunks)
    if architecture is not None:
        state[ARCHITECTURE_KEY] = architecture
    record = model_config_record(chunks)
    if record is not None:
        state[MODEL_CONFIG_KEY] = record

    checkpoint_dir = get_checkpoint_name(save_dir, iteration)
    _on_rank0(lambda: _refuse_foreign_files(checkpoint_dir), f"checking {checkpoint_dir}")
    request = save(state, checkpoint_dir, async_sharded_save=async_queue is not None, overwrite=overwrite)

    def move_tracker() -> None:
        _on_rank0(lambda: write_tracker(save_dir, iteration), f"writing the tracker of {save_dir}", save_dir)

    if async_queue is None:
        move_tracker()
        return
    request.add_finalize_fn(move_tracker)
    async_queue.schedule_async_request(request)


def _rng_compatible(checkpoint_dir: os.PathLike, request: Any, strategy: TorchDistLoadShardedStrategy) -> bool:
    saved = {k for k in load_sharded_metadata(checkpoint_dir, strategy) if k.startswith(f"{RNG_KEY}/")}
    return not collectives.any_rank_true(request.unique_key not in saved)


def _saved_optimizer_state_names(checkpoint_dir: os.PathLike,
                                 strategy: TorchDistLoadShardedStrategy) -> dict[str, set[str]]:
    """``{state name: the model keys saved with it}`` (a chain such as Muon + Adam keeps different states per
    parameter)."""
    names: dict[str, set[str]] = {}
    for key in load_sharded_metadata(checkpoint_dir, strategy):
        if key.startswith(OPTIMIZER_STATE_PREFIX):
            name, _, model_key = key[len(OPTIMIZER_STATE_PREFIX):].partition(".")
            names.setdefault(name, set()).add(model_key)
    return names


def _model_keys_only(keys: set[str]) -> set[str]:
    """Drop keys of other parts of the training state (optimizer, RNG) a load did not ask for."""
    return {k for k in keys if not k.startswith((OPTIMIZER_STATE_PREFIX, "optimizer.", f"{RNG_KEY}/", RNG_KEY))}


def _raise_key_mismatch(checkpoint_dir: os.PathLike, missing: set[str], unexpected: set[str]) -> None:
    unexpected = _model_keys_only(unexpected)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} keys the model needs are missing from the checkpoint: {sorted(missing)[:10]}")
    if unexpected:
        parts.append(f"{len(unexpected)} keys in the checkpoint are not in the model: {sorted(unexpected)[:10]}")
    raise CheckpointingException(f"{checkpoint_dir} does not match the model ({'; '.join(parts)}); load with "
                                 "strict=False to ignore (and log) them")


def _check_format(ckpt_format: str) -> str:
    if ckpt_format not in CKPT_FORMATS:
        raise ValueError(f"ckpt_format ({ckpt_format!r}) must be one of {CKPT_FORMATS}")
    return ckpt_format


def _load_fsdp_dtensor(checkpoint_dir: os.PathLike, model: Any, optimizer: Any, opt_param_scheduler: Any,
                       iteration: int, strict: bool, load_optimizer: bool, load_rng: bool) -> dict[str, Any]:
    from megatron_core.training.fsdp_dtensor_format import load_fsdp_dtensor_checkpoint

    def check(common: dict[str, Any]) -> None:
        check_architecture(common.get("architecture"), unwrap_model_chunks(model), checkpoint_dir)

    return load_fsdp_dtensor_checkpoint(checkpoint_dir, model, optimizer, opt_param_scheduler, iteration=iteration,
                                        strict=strict, load_optimizer=load_optimizer, load_rng=load_rng,
                                        check_common=check)


def load_checkpoint(load_dir: str | os.PathLike | None, model: torch.nn.Module | list[torch.nn.Module],
                    optimizer: Any, opt_param_scheduler: Any, *, iteration: int | None = None, strict: bool = True,
                    load_optimizer: bool = True, load_rng: bool = True, missing_ok: bool = False,
                    verify: bool = True, common_state_dict: dict[str, Any] | None = None,
                    sharded_strategy: TorchDistLoadShardedStrategy | None = None,
                    ckpt_format: str = "torch_dist") -> dict[str, Any] | None:
    """Load a checkpoint saved by :func:`save_checkpoint` under any parallel layout; collective.

    Restores the model chunks, the optimizer and scheduler (unless ``None`` or not
    ``load_optimizer``) and the RNG states (when ``load_rng`` and the (pp, tp, dp) layout is
    unchanged), and returns ``{"iteration", "consumed_train_samples", "extra_state"}``. An optimizer
    passed with ``load_optimizer=False`` keeps a fresh state, but its main (fp32) params are refreshed
    from the loaded weights (``reload_model_params``), as Megatron does for ``--no-load-optim``.

    A ``load_dir`` without a tracker raises (a mistyped path must not train from scratch) unless
    ``missing_ok``, which returns ``None`` ("load if present"). With ``verify`` every file is
    checked against the checkpoint's SHA-256 manifest first. The recorded architecture must match
    the model's (see :mod:`.architecture`), and the iteration in the common state must match the
    directory's. ``strict`` makes model keys missing from the checkpoint and model keys in the
    checkpoint that the model does not have raise, naming them.

    One load reads each file once: a caller that has read the checkpoint's common state
    (``load_common_state_dict``) passes it as ``common_state_dict``, with ``iteration`` and the
    ``sharded_strategy`` it read through (the strategy keeps ``metadata.json`` and ``.metadata``).
    ``ckpt_format="fsdp_dtensor"`` loads a checkpoint saved in that format (``verify`` and the common-state
    arguments do not apply to it).
    """
    _check_format(ckpt_format)
    if load_dir is None:
        if missing_ok:
            return None
        raise CheckpointingException("load_checkpoint needs a load_dir (pass missing_ok=True to allow none)")
    if iteration is None:
        found: list[Any] = [None]

        def read() -> None:
            found[0] = read_tracker(load_dir)

        _on_rank0(read, f"reading the tracker of {load_dir}")
        iteration = collectives.broadcast_object(found[0], 0)
        if iteration is None:
            if missing_ok:
                return None
            what = "does not exist" if not os.path.exists(load_dir) else f"has no {TRACKER_FILENAME}"
            raise CheckpointingException(
                f"cannot load a checkpoint from {load_dir}: the directory {what}. Check the path; pass "
                "missing_ok=True to start from scratch when no checkpoint is there")
    checkpoint_dir = get_checkpoint_name(load_dir, iteration)
    if ckpt_format == "fsdp_dtensor":
        return _load_fsdp_dtensor(checkpoint_dir, model, optimizer, opt_param_scheduler, iteration, strict,
                                  load_optimizer, load_rng)
    strategy = sharded_strategy or TorchDistLoadShardedStrategy()  # passed to every read below
    if not check_is_distributed_checkpoint(checkpoint_dir, strategy.checkpoint_config):
        from megatron_core.training.fsdp_dtensor_format import is_fsdp_dtensor_checkpoint

        hint = " (it was saved with ckpt_format='fsdp_dtensor')" if is_fsdp_dtensor_checkpoint(checkpoint_dir) else ""
        raise CheckpointingException(f"{checkpoint_dir} is not a complete checkpoint (iteration {iteration}){hint}")
    if sharded_strategy is None:
        strategy.check_checkpoint_compatibility(checkpoint_dir)
    if verify:
        verify_checkpoint(checkpoint_dir)
    common = common_state_dict
    if common is None:
        common = load_common_state_dict(checkpoint_dir, sharded_strategy=strategy)
    saved_iteration = common.get("iteration")
    if saved_iteration is not None and int(saved_iteration) != int(iteration):
        raise CheckpointingException(
            f"the common state of {checkpoint_dir} records iteration {saved_iteration} but the directory is named for "
            f"iteration {iteration}: the checkpoint was moved or tampered with")
    check_architecture(common.get(ARCHITECTURE_KEY), unwrap_model_chunks(model), checkpoint_dir)

    chunks = unwrap_model_chunks(model)
    state: dict[str, Any] = _model_sharded_state_dict(chunks)
    with_optimizer = load_optimizer and optimizer is not None
    if with_optimizer:
        if "optimizer" not in common:
            raise CheckpointingException(f"{checkpoint_dir} holds no optimizer state; load with load_optimizer=False")
        names = _saved_optimizer_state_names(checkpoint_dir, strategy)
        state["optimizer"] = optimizer.sharded_state_dict(
            _model_sharded_state_dict(chunks), is_loading=True, state_names=names)
    restore_rng = False
    if load_rng:
        state[RNG_KEY] = sharded_rng_state(for_loading=True)
        restore_rng = _rng_compatible(checkpoint_dir, state[RNG_KEY], strategy)
        if not restore_rng:
            del state[RNG_KEY]
        if not restore_rng and collectives.get_rank() == 0:
            logger.warning("%s was saved under another (pipeline, tensor) parallel layout: RNG states not restored",
                           checkpoint_dir)

    loaded, missing, unexpected = load(state, checkpoint_dir, strategy, strict=StrictHandling.RETURN_ALL,
                                       common_state_dict=common)
    if strict:
        _raise_key_mismatch(checkpoint_dir, missing, unexpected)
    elif missing or unexpected:
        logger.warning("%s: keys missing from the checkpoint %s; keys only in the checkpoint %s", checkpoint_dir,
                       sorted(missing)[:20], sorted(_model_keys_only(unexpected))[:20])
    for key, chunk in zip(_model_keys(chunks), chunks):
        chunk.load_state_dict(loaded[key], strict=strict)
    if with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        if opt_param_scheduler is not None and loaded.get("opt_param_scheduler") is not None:
            opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])
    elif optimizer is not None:
        # The optimizer state is not loaded (fine-tuning, ``--no-load-optim``): the fp32 main params of a
        # bf16/fp16 optimizer still hold the weights it was built from, so refresh them from the loaded model.
        optimizer.reload_model_params()
    if restore_rng and not restore_sharded_rng_state(loaded[RNG_KEY]):
        logger.warning("%s was saved with another data-parallel size: RNG states not restored", checkpoint_dir)
    return {"iteration": int(loaded["iteration"]),
            "consumed_train_samples": int(loaded.get("consumed_train_samples", 0)),
            "extra_state": loaded.get("extra_state")}
