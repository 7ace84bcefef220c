"""Quantized checkpoints: Model Optimizer's state beside a ``dist_checkpointing`` checkpoint.

A quantized model is saved in two parts, as Megatron-LM does:

* the model's sharded state dict, through ``dist_checkpointing.save``: the weights plus every
  quantizer buffer (amax, pre-quantization scale), each split over TP like the channels it
  belongs to (:mod:`.quant_modules`), so the checkpoint reshards like any other;
* Model Optimizer's own record of what was done (``mto.modelopt_state``: the quantization config
  and each quantizer's settings) in ``<checkpoint>/modelopt_state``, written by :func:`save_modelopt_state`.

Loading reverses the order: :func:`load_modelopt_state` quantizes a freshly built model the same
way (Model Optimizer re-creates each quantizer with buffers of this rank's shapes, under the new TP
layout), then ``dist_checkpointing.load(model.sharded_state_dict(), ...)`` fills in the values::

    dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    save_modelopt_state(model, ckpt)
    ...
    load_modelopt_state(new_model, ckpt)           # any TP size
    new_model.load_state_dict(dist_checkpointing.load(new_model.sharded_state_dict(), ckpt))

Module names key the saved quantizer settings; those of MoE experts (whose names hold the local expert
index) are re-keyed for the loading model's expert-parallel size (``quant_moe.modelopt_state_for``).
Pipeline parallelism (whose stages name their
layers from 0) is not supported yet.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_core import dist_checkpointing
from megatron_core.post_training.modelopt._backend import modelopt_modules
from megatron_core.process_groups_config import resolve_process_group

__all__ = ["MODELOPT_STATE_DIR", "check_checkpoint_recipe", "checkpoint_recipe", "has_modelopt_state",
           "load_modelopt_state", "save_modelopt_state"]

MODELOPT_STATE_DIR = "modelopt_state"
_KEY = "modelopt_state"


def _check_no_pipeline() -> None:
    group = resolve_process_group("pp")
    if group is not None and torch.distributed.get_world_size(group) > 1:
        raise NotImplementedError(
            f"quantized checkpoints under pipeline parallelism (size {torch.distributed.get_world_size(group)}) "
            "are not supported yet: Model Optimizer's state is keyed by module names, which differ per stage"
        )


def has_modelopt_state(checkpoint_dir: str | os.PathLike) -> bool:
    """Whether ``checkpoint_dir`` holds Model Optimizer's state (a quantized model's checkpoint)."""
    return (Path(checkpoint_dir) / MODELOPT_STATE_DIR).is_dir()


def save_modelopt_state(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> None:
    """Write Model Optimizer's state of ``model`` to ``<checkpoint_dir>/modelopt_state``; collective over all ranks.

    ``ValueError`` when ``model`` was not converted by Model Optimizer (nothing to save).
    """
    mo = modelopt_modules("saving a quantized checkpoint")
    if not mo.mto.ModeloptStateManager.is_converted(model):
        raise ValueError(f"{type(model).__name__} was not quantized or otherwise converted by Model Optimizer: "
                         "there is no modelopt_state to save")
    _check_no_pipeline()
    state = mo.mto.modelopt_state(model)
    dist_checkpointing.save({_KEY: state}, Path(checkpoint_dir) / MODELOPT_STATE_DIR)


def _saved_state(checkpoint_dir: str | os.PathLike) -> dict:
    if not has_modelopt_state(checkpoint_dir):
        raise ValueError(f"{checkpoint_dir} holds no {MODELOPT_STATE_DIR}/ (not saved from a quantized model with "
                         "save_modelopt_state)")
    common = dist_checkpointing.load_common_state_dict(Path(checkpoint_dir) / MODELOPT_STATE_DIR)
    if _KEY not in common:
        raise ValueError(f"{checkpoint_dir}/{MODELOPT_STATE_DIR} has no {_KEY!r} entry; found {sorted(common)}")
    return common[_KEY]


def checkpoint_recipe(checkpoint_dir: str | os.PathLike) -> str:
    """The name of the quantization config a checkpoint's model was quantized with (see ``recipes.recipe_of``)."""
    from megatron_core.post_training.modelopt.recipes import recipe_of

    return recipe_of(_saved_state(checkpoint_dir))


def check_checkpoint_recipe(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> None:
    """``ValueError`` naming both recipes when ``model`` is quantized otherwise than the checkpoint's model.

    Call before loading a quantized checkpoint's state dict into an already quantized model (its
    quantizer buffers would not fit, or worse, fit and mean something else).
    """
    from megatron_core.post_training.modelopt.recipes import recipe_of

    mo = modelopt_modules("checking a quantized checkpoint")
    saved = _saved_state(checkpoint_dir)
    ours = mo.mto.modelopt_state(model) if mo.mto.ModeloptStateManager.is_converted(model) else {}
    if repr(_quantize_config(saved)) != repr(_quantize_config(ours)):
        raise ValueError(f"{checkpoint_dir} was quantized with {recipe_of(saved)}, but this {type(model).__name__} "
                         f"is quantized with {recipe_of(ours)}; quantize the model with the checkpoint's recipe, or "
                         "load the checkpoint into a freshly built model with load_modelopt_state")


def _quantize_config(state: dict) -> object:
    """The quantize mode's config recorded in a Model Optimizer state (``None`` when unquantized)."""
    return dict(state.get("modelopt_state_dict", [])).get("quantize", {}).get("config")


def load_modelopt_state(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> torch.nn.Module:
    """Convert a freshly built ``model`` the way the checkpoint's model was (quantizers re-created, empty).

    Call before loading the model's own sharded state dict from ``checkpoint_dir``, so that dict
    requests the quantizer buffers too. Returns the converted model (the same object).
    ``ValueError`` when the checkpoint has no Model Optimizer state or ``model`` is already converted
    (naming both recipes when they differ).
    """
    from megatron_core.post_training.modelopt import register_quant_modules

    mo = modelopt_modules("loading a quantized checkpoint")
    register_quant_modules()
    saved = _saved_state(checkpoint_dir)
    if mo.mto.ModeloptStateManager.is_converted(model):
        check_checkpoint_recipe(model, checkpoint_dir)
        raise ValueError(f"{type(model).__name__} is already converted by Model Optimizer; load a quantized "
                         "checkpoint into a freshly built model")
    _check_no_pipeline()
    from megatron_core.post_training.modelopt.quant_moe import modelopt_state_for

    return mo.mto.restore_from_modelopt_state(model, modelopt_state_for(model, saved))
